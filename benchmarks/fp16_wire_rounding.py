"""Where the fp16 wire's loss change comes from (jaxpar/tolerances.py `torchref.fp16wire.loss`).

Replays tests/torchref/test_torchref_strategies.py's `horovod workers=2 compression=fp16` run in one process
(CPU, 1 thread): each step computes both workers' local gradients (rows 0-3 and 4-7 of the (8, 32)
batch), then forms the ring's result fp16(fp16(g0) + fp16(g1)) / 2 exactly as torchref's FusionEngine
and ring_allreduce do (cast, one fp16 add per element, decompress, / N), with the fp16 rounding
applied to every element ("fp16"), only to values under fp16's smallest normal 2^-14 = 6.1e-5
("sub"), only to the normal ones ("norm"), or none ("fp32": horovod's fp32 wire). The "fp16" row
reproduces the test's measured loss difference (6.18e-7 on the AMD Zen 4 host).

    PYTHONPATH=$PWD python benchmarks/fp16_wire_rounding.py [--jitter K]   # writes results/fp16_wire_rounding.json

--jitter K also reruns every mode K times with each worker gradient moved 1 ulp up or down at
random (another fp32 summation order, as another host kind's kernels would give).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch

_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path[:0] = [_TESTS, os.path.join(_TESTS, "torchref")]  # support.*, then the test module itself
from test_torchref_strategies import BASE  # noqa: E402

from torchref.config import resolve_ref  # noqa: E402
from torchref.launch import prepare  # noqa: E402
from torchref.model import build_model, clip_grads_, lr_at, make_optimizer, set_lr  # noqa: E402
from torchref.runtime import Context  # noqa: E402
from torchref.strategies.base import accumulate  # noqa: E402

TINY = np.float32(2.0**-14)  # fp16's smallest normal, 6.1e-5
MODES = ("fp32", "fp16", "sub", "norm")


def wire_round(mode: str, x: np.ndarray) -> np.ndarray:
    """fp32 (n,) -> fp32 (n,): x with the fp16 rounding applied to the elements `mode` selects."""
    if mode == "fp32":
        return x
    h = x.astype(np.float16).astype(np.float32)
    sub = np.abs(x) < TINY
    return {"fp16": h, "sub": np.where(sub, h, x), "norm": np.where(sub, x, h)}[mode]


def flat_grads(params) -> np.ndarray:
    return np.concatenate([p.grad.detach().reshape(-1).numpy().copy() for p in params])


def train(ctx: Context, mode: str, jitter: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
    """10 steps as torchref's allreduce_train_loop; returns (losses (10,), step-1 averaged gradient)."""
    t = ctx.t
    model = build_model(ctx.hf_config(), ctx.init_state_dict())
    named = list(model.named_parameters())
    params = [p for _, p in named]
    opt = make_optimizer(named, t)
    losses, g1 = [], None
    for step in range(t.steps):
        if mode == "single":  # one worker, the whole batch
            opt.zero_grad(set_to_none=True)
            loss = accumulate(ctx, step, 0, 1, model)
        else:
            gs, ls = [], []
            for w in range(2):
                opt.zero_grad(set_to_none=True)
                ls.append(accumulate(ctx, step, w, 2, model))
                gs.append(flat_grads(params))
            loss = sum(ls) / 2  # global_loss: allreduce of the local losses / N
            if jitter is not None:
                gs = [np.where(jitter.random(g.shape) < 0.5, np.nextafter(g, np.float32(np.inf)),
                               np.nextafter(g, np.float32(-np.inf))).astype(np.float32) for g in gs]
            avg = torch.from_numpy(wire_round(mode, wire_round(mode, gs[0]) + wire_round(mode, gs[1]))) / 2
            i = 0
            for p in params:
                p.grad.copy_(avg[i:i + p.numel()].view_as(p.grad))
                i += p.numel()
        if step == 0:
            g1 = flat_grads(params)
        clip_grads_(params, t.grad_clip)
        set_lr(opt, lr_at(t, step))
        opt.step()
        losses.append(loss)
    return np.array(losses), g1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jitter", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "fp16_wire_rounding.json"))
    a = ap.parse_args()
    out = os.path.join(tempfile.mkdtemp(), "run")
    cfg, ref = resolve_ref(BASE + ["strategy=horovod", "workers=2", "horovod.compression=fp16", f"out={out}"])
    ctx = Context(prepare(cfg, ref), 0, 1)
    single, g = train(ctx, "single")
    mag = np.abs(g)
    res = {"elements": int(g.size), "below_fp16_normal": float(np.mean(mag < TINY)),
           "exactly_zero": float(np.mean(mag == 0)), "loss_rel_vs_single": {}, "jitter": {}}
    print(f"step-1 averaged gradient: {g.size} elements, {res['below_fp16_normal']:.4f} below 6.1e-5 "
          f"({res['exactly_zero']:.4f} exactly 0)")
    for m in MODES:
        losses, _ = train(ctx, m)
        rel = np.abs(losses - single) / single
        res["loss_rel_vs_single"][m] = float(rel.max())
        print(f"{m:5s} max loss rel vs single {rel.max():.3e}  per step " + " ".join(f"{x:.1e}" for x in rel))
        if a.jitter:
            v = [float(np.max(np.abs(train(ctx, m, np.random.default_rng(k))[0] - single) / single))
                 for k in range(a.jitter)]
            res["jitter"][m] = v
            print(f"      {a.jitter} 1-ulp jitters: min {min(v):.2e} median {np.median(v):.2e} max {max(v):.2e}")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
