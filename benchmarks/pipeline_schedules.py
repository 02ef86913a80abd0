"""Compiled temp memory of the train step vs M for every pipeline schedule (emulated CPU devices).

    python benchmarks/pipeline_schedules.py [--ms 2,4,8,16,32] [--out results/pipeline_schedules.json]

gpt2-tiny (L=4, D=128, V=256), T=64, 4 rows per microbatch (the batch grows with M), fp32, pipe=2:
gpipe, 1f1b, zb (ZB-H1) and interleaved (R=2 chunks of one layer per rank). For each M: the train
step's temp bytes per device (`jax.jit(...).lower(...).compile().memory_analysis()`, through
`jaxpar.run.inspection.compile_step`), the packed plan's ticks and its stash slots (saved stage
inputs, saved output gradients: `jaxpar.parallel.pipeline_exec.plan_for`). Writes the JSON and a
PNG (temp MiB vs M, one line per schedule) beside it. Temp bytes are deterministic; no timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jaxpar.config import PRESETS, Config, MeshConfig, PipelineConfig, TrainConfig  # noqa: E402
from jaxpar.parallel.pipeline_exec import plan_for  # noqa: E402
from jaxpar.run.inspection import compile_step  # noqa: E402

S, ROWS, SEQ, L = 2, 4, 64, 4
SCHEDULES = {"gpipe": 1, "1f1b": 1, "zb": 1, "interleaved": 2}  # schedule -> repeats R


def temp_bytes(sched: str, R: int, M: int) -> int:
    model = dataclasses.replace(PRESETS["gpt2-tiny"], n_layer=L)
    cfg = Config(model=model, mesh=MeshConfig(pipe=S), precision="fp32",
                 pipeline=PipelineConfig(microbatches=M, schedule=sched, repeats=R),
                 train=TrainConfig(batch_size=M * ROWS, seq_len=SEQ))
    compiled, _ = compile_step(cfg, devices=jax.devices()[:S])
    return compiled.memory_analysis().temp_size_in_bytes


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for sched in SCHEDULES:
        pts = [(r["M"], r[sched]["temp_bytes"] / 2**20) for r in rows if sched in r]
        ax.plot(*zip(*pts), marker="o", label=sched + (f" (R={SCHEDULES[sched]})" if SCHEDULES[sched] > 1 else ""))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("microbatches M (4 rows each)")
    ax.set_ylabel("train step temp MiB per device")
    ax.set_title(f"gpt2-tiny L={L}, T={SEQ}, pipe={S}, fp32 (XLA:CPU)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="2,4,8,16,32")
    ap.add_argument("--out", default=os.path.join(here, "results", "pipeline_schedules.json"))
    a = ap.parse_args()
    rows = []
    for M in (int(m) for m in a.ms.split(",")):
        r = {"M": M}
        for sched, R in SCHEDULES.items():
            r[sched] = {"temp_bytes": temp_bytes(sched, R, M)}
            if sched != "gpipe":
                plan, kx, kg = plan_for(sched, S, M, R)
                r[sched].update(ticks=len(plan), stash_inputs=kx, stash_grads=kg)
        print(f"M={M:>2}: " + ", ".join(f"{s} {r[s]['temp_bytes'] / 2**20:.3f} MiB" for s in SCHEDULES), flush=True)
        rows.append(r)
    out = {"host": {"jax": jax.__version__, "backend": jax.default_backend()},
           "setup": {"model": "gpt2-tiny", "n_layer": L, "seq_len": SEQ, "rows_per_microbatch": ROWS, "pipe": S,
                     "precision": "fp32", "repeats": SCHEDULES}, "memory": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    plot(rows, os.path.splitext(a.out)[0] + ".png")
    print(f"wrote {a.out} and its .png")


if __name__ == "__main__":
    main()
