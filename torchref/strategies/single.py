"""`single`: the study's baseline, one process, one device, no communication."""

from __future__ import annotations

from torchref.strategies.base import Hooks, Strategy, allreduce_train_loop


class Single(Strategy):
    name = "single"

    def world_size(self, workers: int) -> int:
        return 1

    def run(self, ctx) -> None:
        allreduce_train_loop(ctx, 0, 1, lambda model: Hooks())
