"""The optimizer, schedule and batch settings both frameworks run with: the `train.*` keys that
torchref mirrors. jaxpar's `TrainConfig` and torchref's `TrainSettings` extend this one frozen
dataclass, so the names, types, defaults and key order are written once (the schedule itself is
written twice on purpose, once per framework: `jaxpar.train.lr_schedule`, `torchref.model.lr_at`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimSettings:
    steps: int = 1000
    batch_size: int = 8  # global sequences per optimizer step
    seq_len: int = 256
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100  # update k < W = min(warmup_steps, steps) runs at lr*(k+1)/(W+1)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    grad_accum: int = 1
