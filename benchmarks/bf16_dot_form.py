"""The bf16 policy's two dot forms against the fp32 step, one process, CPU time, interleaved.

Variants of the real `build_trainer` train step (`single_device.py` configurations), each compiled
once with `jaxpar.models.precision.FP32_KERNEL_BF16_DOTS` set while it traces:

  fp32          precision=fp32
  bf16_kernel   precision=bf16, every dot bf16 x bf16 -> fp32 (hosts with avx512_bf16/AMX)
  fp32_kernel   precision=bf16, every dot an fp32 dot of the same bf16 values (the default on
                CPUs without native bf16: jaxpar.models.precision.fp32_kernel_bf16_dots)

then `--rounds` rounds of one synchronised step of each in turn (ABC ABC ...), process CPU time per
step (wall time is noise on a shared host). Printed and written (`--out`): the median CPU time per
variant, the median per-round ratio fp32 / variant (> 1: faster than fp32), the operand dtypes of
the compiled step's dots, and the first losses (the two bf16 forms agree to bf16 noise).

    python -m tests.avx2_host python benchmarks/bf16_dot_form.py --configs small --rounds 11   # emulated AVX2
    python benchmarks/bf16_dot_form.py --configs small --rounds 11                              # this host
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import time

VARIANTS = {"fp32": ("fp32", None), "bf16_kernel": ("bf16", False), "fp32_kernel": ("bf16", True)}


def dot_dtypes(hlo: str) -> dict[str, int]:
    """'lhs x rhs -> out' dtype counts of every dot in compiled HLO text."""
    shapes = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    dots = re.findall(r"= (\w+)\[[^=]* dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
    return dict(collections.Counter(f"{shapes[a]} x {shapes[b]} -> {o}" for o, a, b in dots))


def build(dims, precision: str, form):
    """A compiled train step of `dims` under `precision`, the dot form forced while it traces."""
    import jax
    import numpy as np
    from single_device import config_of

    import jaxpar.models.precision as P
    from jaxpar.models.gpt2 import init_params
    from jaxpar.parallel.layout import build_layout
    from jaxpar.train import build_trainer

    _, _, _, vocab, seq, batch = dims
    cfg = config_of(dims, precision)
    mc = cfg.model
    trainer = build_trainer(build_layout(cfg, 1), devices=jax.devices()[:1])
    toks = np.random.default_rng(0).integers(0, vocab, size=(batch, seq + 1)).astype(np.int32)
    x, y = trainer.put_batch(toks[:, :-1]), trainer.put_batch(toks[:, 1:])
    state = [trainer.init_state(init_params(mc, 0))]
    saved, P.FP32_KERNEL_BF16_DOTS = P.FP32_KERNEL_BF16_DOTS, form
    try:
        fn = trainer.step_fn.lower(state[0], x, y).compile()
    finally:
        P.FP32_KERNEL_BF16_DOTS = saved
    losses = []

    def step():
        state[0], m = fn(state[0], x, y)
        losses.append(float(m["loss"]))  # synchronises

    return step, losses, dot_dtypes(fn.as_text())


def measure(name: str, dims, rounds: int) -> dict:
    runs = {v: build(dims, *VARIANTS[v]) for v in VARIANTS}
    for step, _, _ in runs.values():
        step(), step()  # untimed warm-up
    cpu = collections.defaultdict(list)
    for _ in range(rounds):
        for v, (step, _, _) in runs.items():
            c0 = time.process_time()
            step()
            cpu[v].append(time.process_time() - c0)
    return {"config": name, "dims": list(dims), "rounds": rounds, "loadavg": os.getloadavg(),
            "cpu_median_s": {v: statistics.median(t) for v, t in cpu.items()},
            "fp32_over_variant": {v: statistics.median(a / b for a, b in zip(cpu["fp32"], t)) for v, t in cpu.items()},
            "dots": {v: r[2] for v, r in runs.items()}, "losses": {v: r[1][:3] for v, r in runs.items()}}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="small", help="comma list of single_device.py configurations")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from single_device import CONFIGS

    bad = [c for c in args.configs.split(",") if c not in CONFIGS]
    if bad or args.rounds < 1:
        print(f"error: unknown --configs {','.join(bad)} (known: {','.join(CONFIGS)})" if bad
              else f"error: --rounds {args.rounds} < 1", file=sys.stderr)
        sys.exit(2)
    from jaxpar.run.host_memory import keep_freed_memory

    keep_freed_memory()  # before JAX starts, as `jaxpar train`
    from jaxpar.models.precision import fp32_kernel_bf16_dots
    from jaxpar.tolerances import NATIVE_BF16

    reports = []
    for name in args.configs.split(","):
        r = measure(name, CONFIGS[name], args.rounds)
        r |= {"native_bf16": NATIVE_BF16, "default_fp32_kernel": fp32_kernel_bf16_dots()}
        reports.append(r)
        print(f"[{name}] cpu ms/step " + ", ".join(f"{v} {t * 1e3:.1f}" for v, t in r["cpu_median_s"].items())
              + "; fp32/variant " + ", ".join(f"{v} {x:.3f}" for v, x in r["fp32_over_variant"].items())
              + f"; load {r['loadavg'][0]:.1f}; native bf16 {NATIVE_BF16}, default form "
              + ("fp32_kernel" if r["default_fp32_kernel"] else "bf16_kernel"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(reports, f, indent=2)
        print(f"wrote {args.out}")
    return reports


if __name__ == "__main__":
    main()
