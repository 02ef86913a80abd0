"""`single-ps`: one parameter server, N workers, all traffic through the server.

Rank 0 is the server: it holds the master weights and the AdamW state and never runs the model.
Ranks 1..N are workers (worker w = rank w+1) holding a replica used only for forward/backward.
One synchronous step (torch.distributed point-to-point, gloo on CPU / NCCL on GPU):

    worker w: grad_w of its rows -> send flat fp32 grad (Psi bytes) to the server
    server:   receive N grads, average, clip, AdamW step -> send the flat weights (Psi) to each
    worker w: receive the weights into its replica

so the server moves 2*Psi*N bytes per step (N*Psi in, N*Psi out) and each worker Psi each way;
the server's link is the bottleneck the study measured.

`ps.async=true` (asynchronous SGD, bounded staleness; NOT loss-equivalent to `single`): the
server applies each worker's gradient as soon as it arrives (one optimizer step per gradient,
on that worker's B/N rows) and replies with fresh weights. A gradient computed on weights more
than `ps.max_staleness` versions old is dropped and the worker simply pulls again. Worker w uses
its rows of the global batch numbered by the weight version it pulled.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchref.comm import ByteCounter, flatten, unflatten_into
from torchref.model import build_model, clip_grads_, hf_state_dict, lr_at, make_optimizer, save_weights, set_lr
from torchref.rank_exit import check_finite
from torchref.runtime import Metrics, timer
from torchref.strategies.base import Strategy, accumulate

GRAD, WEIGHTS, CTRL = 1, 2, 3  # message tags


class SinglePS(Strategy):
    name = "single-ps"

    def world_size(self, workers: int) -> int:
        return workers + 1  # + the server

    def run(self, ctx) -> None:
        ctx.init_process_group()
        try:
            if ctx.rank == 0:
                (serve_async if ctx.ref.ps.async_ else serve)(ctx)
            else:
                (work_async if ctx.ref.ps.async_ else work)(ctx)
        finally:
            dist.destroy_process_group()


def _master(ctx):
    """Server-side master weights as a model (never run) and the optimizer."""
    model = build_model(ctx.hf_config(), ctx.init_state_dict()).to(ctx.device)
    named = list(model.named_parameters())
    return model, named, make_optimizer(named, ctx.t)


def applies(version: int, computed_on: int, steps: int, max_staleness: int) -> bool:
    """Async PS: does the server, at weight version `version`, apply a gradient computed on version
    `computed_on`? Only before the last step, and when at most `max_staleness` versions old (a
    gradient exactly `max_staleness` old is applied; max_staleness=0 applies fresh ones only)."""
    return version < steps and version - computed_on <= max_staleness


def _wait(works) -> None:
    for w in works:
        w.wait()


def serve(ctx) -> None:
    n, t = ctx.world - 1, ctx.t
    model, named, opt = _master(ctx)
    params = [p for _, p in named]
    psi = sum(p.numel() for p in params)
    counter, per_worker, totals = ByteCounter(), ByteCounter(), ByteCounter()
    metrics = Metrics(ctx, strategy="single-ps", workers=n, ps_async=False)
    flat = flatten([p.data for p in params])
    _wait([dist.isend(flat, w) for w in range(1, n + 1)])  # initial pull (setup, not counted per step)
    grads = [torch.empty(psi, device=ctx.device) for _ in range(n)]
    losses = [torch.empty(1, dtype=torch.float64, device=ctx.device) for _ in range(n)]
    for step in range(t.steps):
        t0 = timer()
        works = [dist.irecv(grads[w - 1], w, tag=GRAD) for w in range(1, n + 1)]
        works += [dist.irecv(losses[w - 1], w, tag=CTRL) for w in range(1, n + 1)]
        _wait(works)
        counter.add(received=n * psi * 4)
        per_worker.add(sent=psi * 4)
        avg = grads[0].clone()
        for g in grads[1:]:
            avg += g
        avg /= n
        for p in params:
            p.grad = torch.empty_like(p)
        unflatten_into(avg, [p.grad for p in params])
        ctx.save_grads(step + 1, {name: p.grad for name, p in named})
        norm = clip_grads_(params, t.grad_clip)
        loss = float(sum(float(x[0]) for x in losses)) / n
        check_finite(step + 1, loss, norm)  # the workers then lose the server and stop
        lr = lr_at(t, step)
        set_lr(opt, lr)
        opt.step()
        flat = flatten([p.data for p in params])
        _wait([dist.isend(flat, w, tag=WEIGHTS) for w in range(1, n + 1)])
        counter.add(sent=n * psi * 4)
        per_worker.add(received=psi * 4)
        dt = timer() - t0
        s, r = counter.take()
        ws, wr = per_worker.take()
        totals.add(s, r)
        metrics.log(step + 1, loss, dt, bytes_sent=ws, bytes_received=wr, server_bytes_sent=s,
                    server_bytes_received=r, lr=lr, grad_norm=norm)
    metrics.close()
    save_weights(f"{ctx.job.out}/hf", ctx.hf_config(), hf_state_dict(model))
    ctx.write_summary("server", bytes_sent=totals.sent, bytes_received=totals.received)


def work(ctx) -> None:
    n, w, t = ctx.world - 1, ctx.rank - 1, ctx.t
    model = build_model(ctx.hf_config(), None).to(ctx.device)  # weights come from the server
    params = list(model.parameters())
    psi = sum(p.numel() for p in params)
    flat = torch.empty(psi, device=ctx.device)
    dist.recv(flat, 0)
    totals = ByteCounter()
    with torch.no_grad():
        unflatten_into(flat, [p.data for p in params])
    for step in range(t.steps):
        ctx.maybe_crash(w, step + 1)
        model.zero_grad(set_to_none=True)
        loss = accumulate(ctx, step, w, n, model)
        g = flatten([p.grad for p in params])
        _wait([dist.isend(g, 0, tag=GRAD),
               dist.isend(torch.tensor([loss], dtype=torch.float64, device=ctx.device), 0, tag=CTRL)])
        dist.recv(flat, 0, tag=WEIGHTS)
        totals.add(psi * 4, psi * 4)
        with torch.no_grad():
            unflatten_into(flat, [p.data for p in params])
    ctx.write_summary("worker", bytes_sent=totals.sent, bytes_received=totals.received)


# ----------------------------------------------------------------------------- asynchronous

def serve_async(ctx) -> None:
    n, t = ctx.world - 1, ctx.t
    model, named, opt = _master(ctx)
    params = [p for _, p in named]
    psi = sum(p.numel() for p in params)
    metrics = Metrics(ctx, strategy="single-ps", workers=n, ps_async=True, max_staleness=ctx.ref.ps.max_staleness)
    totals = ByteCounter()
    version, dropped = 0, 0
    active = set(range(1, n + 1))
    hdr = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # [weight version the grad was computed on, loss]
    grad = torch.empty(psi, device=ctx.device)
    reply = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # [stop flag, version]

    def push_weights(w: int) -> None:
        reply[0], reply[1] = float(version >= t.steps), float(version)
        dist.send(reply, w, tag=CTRL)
        if version < t.steps:
            dist.send(flatten([p.data for p in params]), w, tag=WEIGHTS)
            totals.add(sent=psi * 4)
        else:
            active.discard(w)

    for w in range(1, n + 1):
        push_weights(w)
    t0 = timer()
    while active:
        src = dist.recv(hdr, None, tag=CTRL)  # any worker
        dist.recv(grad, src, tag=GRAD)
        totals.add(received=psi * 4)
        staleness = version - int(hdr[0])
        if applies(version, int(hdr[0]), t.steps, ctx.ref.ps.max_staleness):
            for p in params:
                p.grad = torch.empty_like(p)
            unflatten_into(grad, [p.grad for p in params])
            norm = clip_grads_(params, t.grad_clip)
            check_finite(version + 1, float(hdr[1]), norm)
            lr = lr_at(t, version)
            set_lr(opt, lr)
            opt.step()
            version += 1
            dt, t0 = timer() - t0, timer()
            metrics.log(version, float(hdr[1]), dt, bytes_sent=psi * 4, bytes_received=psi * 4,
                        server_bytes_sent=psi * 4, server_bytes_received=psi * 4, lr=lr, grad_norm=norm,
                        worker=src - 1, staleness=staleness, dropped=dropped)
        elif version < t.steps:
            dropped += 1
        push_weights(src)
    metrics.close()
    save_weights(f"{ctx.job.out}/hf", ctx.hf_config(), hf_state_dict(model))
    ctx.write_summary("server", bytes_sent=totals.sent, bytes_received=totals.received, dropped=dropped)


def work_async(ctx) -> None:
    n, w = ctx.world - 1, ctx.rank - 1
    model = build_model(ctx.hf_config(), None).to(ctx.device)
    params = list(model.parameters())
    psi = sum(p.numel() for p in params)
    flat, reply = torch.empty(psi, device=ctx.device), torch.zeros(2, dtype=torch.float64, device=ctx.device)
    totals, pushes = ByteCounter(), 0
    while True:
        dist.recv(reply, 0, tag=CTRL)
        if reply[0] > 0:
            break
        version = int(reply[1])
        dist.recv(flat, 0, tag=WEIGHTS)
        with torch.no_grad():
            unflatten_into(flat, [p.data for p in params])
        pushes += 1
        ctx.maybe_crash(w, pushes)
        model.zero_grad(set_to_none=True)
        loss = accumulate(ctx, version, w, n, model)
        dist.send(torch.tensor([float(version), loss], dtype=torch.float64, device=ctx.device), 0, tag=CTRL)
        dist.send(flatten([p.grad for p in params]), 0, tag=GRAD)
        totals.add(psi * 4, psi * 4)
    ctx.write_summary("worker", bytes_sent=totals.sent, bytes_received=totals.received, pushes=pushes)
