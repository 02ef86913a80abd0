"""The Strategy interface and the training loop the all-reduce strategies share.

A strategy says how many OS processes it needs, how they are started (`fork` from the warm
launcher, or `mpi` under mpiexec) and what each process runs (`run(ctx)`). The synchronous
strategies all compute the same update as `single`:

    worker w of N: loss_w = mean CE over rows w*B/N..(w+1)*B/N of the global batch (B, T)
    averaged grad  = (1/N) sum_w grad(loss_w) = grad(mean CE over the global batch)
    then, identically on every replica (or once on the server): clip -> AdamW(lr_at(step)).

`train.grad_accum` = A: each worker runs A forward/backward passes over A microbatches of its rows
(`Context.microbatches`), each loss scaled by 1/A so `.grad` accumulates the shard's mean gradient;
the strategy communicates once, after the last pass (DDP `no_sync`, Horovod's
`backward_passes_per_step`), so the update is the same as with A = 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import ClassVar

import torch

from torchref.comm import ByteCounter
from torchref.handoff import due
from torchref.handoff import save as save_state
from torchref.model import build_model, clip_grads_, loss_fn, lr_at, make_optimizer, set_lr
from torchref.rank_exit import check_finite
from torchref.runtime import Context, Metrics, timer


class Strategy:
    name: ClassVar[str]
    launcher: ClassVar[str] = "fork"  # fork: forked from the launcher; mpi: under mpiexec
    amp: ClassVar[bool] = False

    def world_size(self, workers: int) -> int:
        """OS processes this strategy runs for `workers` data-parallel workers."""
        return workers

    def run(self, ctx: Context) -> None:
        """The body of process `ctx.rank`."""
        raise NotImplementedError


class Hooks:
    """What an all-reduce strategy plugs into `allreduce_train_loop`."""

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:  # e.g. DDP(model)
        return model

    def microbatch(self, last: bool):
        """Context around one accumulation pass (forward + backward); communicate only if `last`."""
        return contextlib.nullcontext()

    def after_backward(self) -> None:  # e.g. wait for outstanding all-reduces
        pass

    def global_loss(self, local_loss: float) -> float:  # mean over workers (control traffic)
        return local_loss

    def bytes_this_step(self) -> tuple[int, int]:
        return 0, 0

    def step_metrics(self) -> dict:  # strategy-specific fields of this step's metrics row
        return {}


def allreduce_train_loop(ctx: Context, worker: int, n: int, make_hooks: Callable[[torch.nn.Module], Hooks],
                         initial_weights: bool = True, **static) -> None:
    """Data-parallel loop of single / DDP / Horovod. Rank 0 writes metrics and the final weights."""
    t = ctx.t
    model = build_model(ctx.hf_config(), ctx.init_state_dict() if initial_weights else None).to(ctx.device)
    hooks = make_hooks(model)
    wrapped = hooks.wrap(model)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    opt = make_optimizer(named, t)
    start = 0
    if ctx.cfg.init_state:  # every replica loads the same moments (torchref.handoff)
        from torchref.handoff import load_optimizer

        start = load_optimizer(opt, named, ctx.cfg.init_state)
    scaler = ctx.grad_scaler()
    metrics = Metrics(ctx, strategy=ctx.ref.strategy, workers=n, **static) if worker == 0 else None
    totals = ByteCounter()
    for step in range(start, t.steps):
        ctx.maybe_crash(worker, step + 1)
        t0 = timer()
        opt.zero_grad(set_to_none=True)
        local_loss = accumulate(ctx, step, worker, n, wrapped, scaler, hooks.microbatch)
        hooks.after_backward()  # grads now hold the average over workers
        if scaler:
            scaler.unscale_(opt)
        if worker == 0:
            ctx.save_grads(step + 1, {name: p.grad for name, p in named})
        norm = clip_grads_(params, t.grad_clip)
        gl = hooks.global_loss(local_loss)  # the same on every rank, as norm is: all stop at one step
        check_finite(step + 1, gl, norm, norm_counts=scaler is None)
        lr = lr_at(t, step)
        set_lr(opt, lr)
        if scaler:
            scaler.step(opt)  # skipped (and the scale halved) when the grads hold inf/nan
            scaler.update()
        else:
            opt.step()
        dt = timer() - t0
        sent, received = hooks.bytes_this_step()
        totals.add(sent, received)
        step_fields = hooks.step_metrics()  # taken on every rank (resets per-step state)
        if metrics:
            extra = {"loss_scale": float(scaler.get_scale())} if scaler else {}
            extra.update(step_fields)
            metrics.log(step + 1, gl, dt, bytes_sent=sent, bytes_received=received, lr=lr, grad_norm=norm, **extra)
        if worker == 0 and due(ctx.ref.state_every, step + 1, t.steps):
            save_state(ctx, model, opt, named, step + 1)
    if metrics:
        metrics.close()
        from torchref.model import hf_state_dict, save_weights

        save_weights(f"{ctx.job.out}/hf", ctx.hf_config(), hf_state_dict(model))
    ctx.write_summary("worker", bytes_sent=totals.sent, bytes_received=totals.received)


def accumulate(ctx: Context, step: int, worker: int, n: int, model: torch.nn.Module, scaler=None,
               microbatch: Callable[[bool], contextlib.AbstractContextManager] | None = None) -> float:
    """Forward + backward over this worker's `train.grad_accum` microbatches of step `step`;
    `.grad` ends up holding the gradient of the shard's mean loss. Returns that mean loss."""
    mbs = ctx.microbatches(step, worker, n)
    a, total = len(mbs), 0.0
    for i, (x, y) in enumerate(mbs):
        with microbatch(i == a - 1) if microbatch else contextlib.nullcontext():
            with ctx.amp_context():
                loss = loss_fn(model, x, y)
            scaled = loss / a if a > 1 else loss
            (scaler.scale(scaled) if scaler else scaled).backward()
        total += float(loss.detach())
    return total / a
