"""1F1B vs GPipe on emulated CPU devices: compiled temp memory vs M, step time, collective bytes.

    python benchmarks/pipeline_1f1b.py [--part memory,time,comm] [--out results/pipeline_1f1b.json]

memory: the train step's compiled temp bytes per device (`memory_analysis`) for gpt2-tiny
        (L=4, D=128, V=256), T=64, 4 rows per microbatch, pipe=2 and pipe=4, M = S .. 16:
        rows per microbatch fixed, so the batch grows with M. 1F1B predicts a flat line once
        M >= 2S-1 (ring of min(M, 2S-1) stage inputs); GPipe grows by one stage input per
        microbatch plus the (B, T, D) embedded inputs / outputs and (B, T, V) logits.
time:   median step wall time and process CPU time over 5 steps after 2 warm-ups, one
        process, the two schedules interleaved; gpt2-tiny L=4 on pipe=2 and pipe=4, M=8.
comm:   collective wire bytes per device of data=2×fsdp=2×pipe=2, gpt2 (vocab 50304), batch
        16×512, M=4, fp32, vs `jaxpar.run.inspection.theory_bytes` (as benchmarks/comm_volume.py counts them).
Timings on a shared host are upper bounds; the JSON records the load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.config import PRESETS, Config, MeshConfig, PipelineConfig, TrainConfig  # noqa: E402
from jaxpar.models import gpt2  # noqa: E402
from jaxpar.run.inspection import COLLECTIVES, collective_bytes, compile_step, theory_bytes  # noqa: E402

SCHEDULES = ("gpipe", "1f1b")


def _cfg(model, sizes: dict, M: int, sched: str, rows: int, seq: int, precision="fp32") -> Config:
    dp = sizes.get("data", 1) * sizes.get("fsdp", 1)
    return Config(model=model, mesh=MeshConfig(**sizes), precision=precision,
                  pipeline=PipelineConfig(microbatches=M, schedule=sched),
                  train=TrainConfig(batch_size=M * dp * rows, seq_len=seq))


def _devices(sizes: dict):
    return jax.devices()[:int(np.prod(list(sizes.values())))]


def memory() -> list[dict]:
    model = dataclasses.replace(PRESETS["gpt2-tiny"], n_layer=4)
    rows = []
    for S in (2, 4):
        for M in sorted({S, 2 * S - 1, 2 * S, 8, 16}):
            r = {"pipe": S, "M": M}
            for sched in SCHEDULES:
                compiled, _ = compile_step(_cfg(model, {"pipe": S}, M, sched, 4, 64), devices=_devices({"pipe": S}))
                r[sched] = compiled.memory_analysis().temp_size_in_bytes
            print(f"pipe={S} M={M:>2}: temp gpipe {r['gpipe'] / 2**20:7.3f} MiB, 1f1b {r['1f1b'] / 2**20:7.3f} MiB",
                  flush=True)
            rows.append(r)
    return rows


def step_time() -> list[dict]:
    model = dataclasses.replace(PRESETS["gpt2-tiny"], n_layer=4)
    rows = []
    for S in (2, 4):
        runs = {}
        for sched in SCHEDULES:
            cfg = _cfg(model, {"pipe": S}, 8, sched, 4, 64)
            compiled, tr = compile_step(cfg, devices=_devices({"pipe": S}))
            state = tr.init_state(gpt2.init_params(model, 0))
            x = tr.put_batch(np.random.default_rng(0).integers(0, 256, (cfg.train.batch_size, 64), dtype=np.int32))
            runs[sched] = [compiled, state, x, [], []]
        for i in range(7):  # interleaved: the two schedules see the same host load
            for run in runs.values():
                compiled, state, x, wall, cpu = run
                w0, c0 = time.perf_counter(), time.process_time()
                state, m = compiled(state, x, x)
                jax.block_until_ready(m["loss"])
                run[1] = state
                if i >= 2:
                    wall.append(time.perf_counter() - w0)
                    cpu.append(time.process_time() - c0)
        r = {"pipe": S, "M": 8, **{f"{s}_{k}": statistics.median(runs[s][j]) for s in SCHEDULES
                                   for j, k in ((3, "wall_s"), (4, "cpu_s"))}}
        r["ratio_wall"], r["ratio_cpu"] = r["1f1b_wall_s"] / r["gpipe_wall_s"], r["1f1b_cpu_s"] / r["gpipe_cpu_s"]
        print(f"pipe={S} M=8: gpipe {r['gpipe_wall_s']:.3f} s ({r['gpipe_cpu_s']:.3f} CPU), 1f1b "
              f"{r['1f1b_wall_s']:.3f} s ({r['1f1b_cpu_s']:.3f} CPU): 1f1b/gpipe {r['ratio_wall']:.2f} wall, "
              f"{r['ratio_cpu']:.2f} CPU", flush=True)
        rows.append(r)
    return rows


def comm() -> list[dict]:
    model = dataclasses.replace(PRESETS["gpt2"], vocab_size=50304)
    sizes = {"data": 2, "fsdp": 2, "pipe": 2}
    rows = []
    for sched in SCHEDULES:
        cfg = dataclasses.replace(_cfg(model, sizes, 4, sched, 1, 512), model_name="gpt2")  # batch 16, as comm_volume
        compiled, tr = compile_step(cfg)
        coll = collective_bytes(compiled.as_text())
        th = theory_bytes(tr.cfg)
        r = {"schedule": sched, "measured": {k: coll[k]["wire_bytes"] for k in COLLECTIVES},
             "total": coll["total_wire_bytes"], "theory": th, "ratio": coll["total_wire_bytes"] / th["total"],
             "memory_temp_bytes": compiled.memory_analysis().temp_size_in_bytes}
        print(f"data=2×fsdp=2×pipe=2 gpt2 16×512 M=4 {sched:>5}: measured {r['total'] / 2**20:8.1f} MiB, theory "
              f"{th['total'] / 2**20:8.1f} MiB, ratio {r['ratio']:.3f}; " +
              ", ".join(f"{k} {v / 2**20:.1f}" for k, v in r["measured"].items() if v), flush=True)
        rows.append(r)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="memory,time,comm")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "pipeline_1f1b.json"))
    a = ap.parse_args()
    parts = {"memory": memory, "time": step_time, "comm": comm}
    out = {"host": {"loadavg": os.getloadavg(), "cpus": os.cpu_count(), "jax": jax.__version__}}
    if os.path.exists(a.out):
        with open(a.out) as f:
            out = {**json.load(f), "host": out["host"]}
    for p in a.part.split(","):
        out[p] = parts[p]()
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
