"""Table schedules (1f1b, zb, interleaved) as a loss train.py differentiates: a custom VJP.

`pipeline.schedule=1f1b | zb | interleaved`. The step itself - one `lax.scan` under `shard_map`
running the schedule's plan, with the backward written by hand - is
`jaxpar.parallel.pipeline_exec`; the tables are `jaxpar.parallel.schedules`.

1F1B (PipeDream-flush), packed for lock step: at tick t rank s forwards microbatch t - s and runs
the fused backward of microbatch t - (2S-2-s); N = M + 2S - 2 ticks; rank s holds an input from
its forward to its backward, 2S-1-2s microbatches, min(M, 2S-1) on rank 0, independent of M.
Idle lanes are skipped, so a fill tick costs one forward and a drain tick one backward: step time
(M+S-1)·(F+B), GPipe's bubble (S-1)/(M+S-1) (`jaxpar.parallel.layout.bubble_fraction`).
Measured (train step temp bytes, gpt2-tiny L=4, T=64, 4 rows per microbatch, pipe=2): GPipe 14.8
-> 19.3 MiB from M=4 to 16, 1F1B 13.88 -> 13.91 MiB (benchmarks/pipeline_1f1b.py).

Autodiff sees a `jax.custom_vjp` loss: the forward runs the whole step and keeps the grads as its
residual, the backward returns cotangent·grads (float0 for the token ids), so
`jax.value_and_grad(loss_fn)` in train.py is unchanged. Evaluation and sampling keep the GPipe
forward (`jaxpar.parallel.pipeline.make_pipeline_logits_fn`). model.dropout > 0 draws GPipe's
masks; pipeline.gather=layer gathers each layer's fsdp shards where it runs (forward and every
re-run), its gradients reduce-scattered there.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config import Config
from jaxpar.parallel import schedules as sc
from jaxpar.parallel.layout import ParallelLayout
from jaxpar.parallel.pipeline_exec import make_schedule_step


def schedule_table(S: int, M: int) -> np.ndarray:
    """(N, S, 2) int: [forward microbatch, backward microbatch] of each rank at each tick of the
    packed 1f1b plan, -1 idle (what the executor runs)."""
    plan = sc.lockstep(sc.make_table("1f1b", S, M))
    return np.stack([np.where(plan[:, :, 0, 0] == sc.F, plan[:, :, 0, 1], -1),
                     np.where(plan[:, :, 1, 0] == sc.BW, plan[:, :, 1, 1], -1)], -1)


def make_schedule_loss_fn(cfg: Config, lay: ParallelLayout, mesh) -> Callable:
    """(params, inputs (B,T), targets (B,T), key|None) -> mean fp32 loss whose gradient (via
    `jax.custom_vjp`) is the one the table schedule computed alongside it; `key` draws
    model.dropout's masks as the GPipe schedule does (`pipeline_exec.make_schedule_step`)."""
    steps = {d: make_schedule_step(cfg, lay, mesh, dropout=d) for d in (False, True)}

    def custom(dropout: bool):
        step = steps[dropout]

        @jax.custom_vjp
        def loss(params, inputs, targets, key):
            return step(params, inputs, targets, key)[0]

        def fwd(params, inputs, targets, key):
            value, grads = step(params, inputs, targets, key)
            return value, (grads, inputs, targets, key)

        def bwd(res, ct):
            grads, *ints = res
            zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731  (integer inputs, the key)
            return (jax.tree.map(lambda g: (ct * g).astype(g.dtype), grads), *map(zero, ints))

        loss.defvjp(fwd, bwd)
        return loss

    losses = {d: custom(d) for d in (False, True)}

    def loss_fn(params, inputs, targets, key=None):
        if key is None or cfg.model.dropout == 0:
            return losses[False](params, inputs, targets, jnp.zeros((2,), jnp.uint32))
        return losses[True](params, inputs, targets, key)

    return loss_fn
