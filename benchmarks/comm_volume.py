"""Collective bytes per step, measured from compiled HLO vs textbook theory, on 8 emulated CPU devices.

    python benchmarks/comm_volume.py [--models gpt2,gpt2-medium] [--strategies dp,fsdp,tp,dp_fsdp_tp]
                                     [--batch 16] [--seq 512] [--precision fp32] [--out comm_volume.json]

Compile-only (nothing is allocated), so full-size models fit on a laptop. Per strategy it
prints per-device wire bytes per kind (ring model, see `jaxpar.run.inspection`), the theory
(DP 2(N-1)/N·Ψ, ZeRO-3 3(N-1)/N·Ψ, Megatron 8·b·s·h·(t-1)/t per layer, pipeline
ppermutes 2·N_iter·b·s·h; exact terms in `jaxpar.run.inspection.theory_bytes`), their ratio, and
the largest measured ops, so every excess can be traced to an op. The vocabulary is padded
to 50304 (as nanoGPT does) because 50257 is not divisible by any tensor size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpar.config import PRESETS, Config, MeshConfig, PipelineConfig, TrainConfig  # noqa: E402
from jaxpar.parallel.sharding import NAMED_MESHES  # noqa: E402
from jaxpar.run.inspection import COLLECTIVES, collective_bytes, compile_step, memory_per_device, theory_bytes  # noqa: E402

MiB = 2**20
# pipelined rows (GPipe, 4 microbatches per data replica): (mesh, microbatches)
PIPE_STRATEGIES = {"pp": (MeshConfig(data=2, pipe=4), 4), "dp_fsdp_pp": (MeshConfig(data=2, fsdp=2, pipe=2), 4)}


def measure(model: str, strategy: str, batch: int, seq: int, precision: str) -> dict:
    m = dataclasses.replace(PRESETS[model], vocab_size=50304)
    mesh, micro = PIPE_STRATEGIES.get(strategy, (NAMED_MESHES.get(strategy), 1))
    cfg = Config(model=m, model_name=model, mesh=mesh, precision=precision,
                 train=TrainConfig(batch_size=batch, seq_len=seq), pipeline=PipelineConfig(microbatches=micro))
    t0 = time.perf_counter()
    compiled, trainer = compile_step(cfg)
    coll = collective_bytes(compiled.as_text())
    th = theory_bytes(trainer.cfg)
    top = sorted(coll["ops"], key=lambda r: -r["wire_bytes"] * r["times"])[:6]
    return {"model": model, "strategy": strategy, "mesh": dataclasses.asdict(trainer.cfg.mesh),
            "compile_s": time.perf_counter() - t0, "memory_per_device_bytes": memory_per_device(compiled),
            "measured": {k: coll[k]["wire_bytes"] for k in COLLECTIVES} | {"total": coll["total_wire_bytes"]},
            "theory": th, "ratio": coll["total_wire_bytes"] / th["total"],
            "top_ops": [{k: r[k] for k in ("kind", "group", "times", "wire_bytes", "op_name")} for r in top]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2,gpt2-medium")
    ap.add_argument("--strategies", default=",".join([*NAMED_MESHES, *PIPE_STRATEGIES]))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--out", default="comm_volume.json")
    ap.add_argument("--top", action="store_true", help="print the largest ops of each row")
    a = ap.parse_args()
    rows = []
    hdr = (f"{'model':<12}{'strategy':<12}{'all-reduce':>11}{'all-gather':>11}{'red-scat':>9}{'all2all':>9}"
           f"{'permute':>9}{'measured':>10}{'theory':>10}{'ratio':>7}  theory parts (MiB)")
    print(f"per-device collective MiB per step; batch {a.batch}×{a.seq}, {a.precision}, 8 emulated CPU devices")
    print(hdr)
    for model in a.models.split(","):
        for s in a.strategies.split(","):
            r = measure(model, s, a.batch, a.seq, a.precision)
            rows.append(r)
            mm, th = r["measured"], r["theory"]
            parts = ", ".join(f"{k} {th[k] / MiB:.1f}" for k in ("dp", "fsdp", "tp", "pipe") if th[k])
            print(f"{model:<12}{s:<12}" + "".join(f"{mm[k] / MiB:>{w}.1f}" for k, w in zip(COLLECTIVES, (11, 11, 9, 9, 9)))
                  + f"{mm['total'] / MiB:>10.1f}{th['total'] / MiB:>10.1f}{r['ratio']:>7.3f}  {parts}", flush=True)
            if a.top:
                for op in r["top_ops"]:
                    print(f"      {op['kind']:<18} n={op['group']} ×{op['times']:.0f} "
                          f"{op['wire_bytes'] * op['times'] / MiB:8.2f} MiB  {op['op_name'][:90]}")
    with open(a.out, "w") as f:
        json.dump({"batch": a.batch, "seq": a.seq, "precision": a.precision, "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
