"""tensor.sequence_parallel on or off: compiled memory, collectives and step time on 4 emulated CPU devices.

    python benchmarks/sequence_parallel.py [--steps 8] [--rounds 3] [--out benchmarks/results/sequence_parallel.json]

For two small GPT-2 shapes and tensor = 2, 4 (data = 4 / tensor, fp32, remat none, no pipeline) it
compiles jaxpar's train step with and without sequence parallelism and records the compiled temp
and total bytes per device, the collective ops and wire bytes from the optimised HLO, the median
wall time of a step (rounds alternate off / on so host load drifts hit both alike), and the
planner's prediction of each (the `cpu` row, and the same strategy on an H100 for the GPU view).

What XLA:CPU can show: the memory (the LayerNorm / residual activations on T/t shards) and the
collective count. What it cannot: XLA:CPU has no reduce-scatter, so the row-parallel output stays
an all-reduce followed by a slice and SP only adds all-gathers; on GPUs XLA's reduce-scatter
creator turns the pair into a reduce-scatter, and SP then moves the all-reduce's bytes, no more.
CPU step times are noisy (a 2-core host shared with other jobs): a difference below ~10% is noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {  # name -> (n_layer, n_embd, n_head, vocab, seq_len, batch)
    "tiny": (2, 128, 4, 256, 128, 16),  # gpt2-tiny's layers at T = 128
    "small": (4, 256, 8, 2048, 128, 16),  # benchmarks/planner_accuracy.py's model
}
TENSOR = (2, 4)
DEVICES = 4
KINDS = ("all-reduce", "all-gather", "reduce-scatter")


def _cfg(shape: str, t: int, sp: bool):
    from jaxpar.config import Config, MeshConfig, ModelConfig, TensorConfig, TrainConfig

    L, D, H, V, T, B = SHAPES[shape]
    m = ModelConfig(n_layer=L, n_embd=D, n_head=H, vocab_size=V, n_positions=max(T, 256))
    return Config(model=m, mesh=MeshConfig(data=DEVICES // t, tensor=t), precision="fp32", tensor=TensorConfig(sp),
                  train=TrainConfig(batch_size=B, seq_len=T))


def predicted(shape: str, t: int, sp: bool) -> dict:
    from jaxpar.planner.cost import Strategy, Workload, estimate
    from jaxpar.planner.devices import get_device

    cfg = _cfg(shape, t, sp)
    s = Strategy(DEVICES // t, 1, t, 1, seq_parallel=sp)
    cpu = estimate(Workload(cfg.model, cfg.train.batch_size, cfg.train.seq_len, "fp32"), s, get_device("cpu"))
    gpu = estimate(Workload(cfg.model, cfg.train.batch_size, cfg.train.seq_len, "bf16"), s, get_device("h100"))
    return {"memory": cpu.memory["total"], "step_s": cpu.step_time_s, "comm_bytes": dict(cpu.comm_bytes),
            "h100_memory": gpu.memory["total"], "h100_step_s": gpu.step_time_s}


def measure_pair(shape: str, t: int, steps: int, rounds: int) -> dict:
    """Compile and time the step with SP off and on; alternate the timing rounds."""
    import jax
    import numpy as np

    from jaxpar.models.gpt2 import init_params
    from jaxpar.parallel.layout import build_layout
    from jaxpar.run.inspection import collective_bytes, memory_per_device
    from jaxpar.train import build_trainer

    runs = {}
    for sp in (False, True):
        cfg = _cfg(shape, t, sp)
        tr = build_trainer(build_layout(cfg, DEVICES), devices=jax.devices()[:DEVICES])
        toks = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1))
        x, y = tr.put_batch(toks[:, :-1].astype(np.int32)), tr.put_batch(toks[:, 1:].astype(np.int32))
        state = tr.init_state(init_params(cfg.model, 0))
        fn = tr.step_fn.lower(state, x, y).compile()
        coll = collective_bytes(fn.as_text())
        runs[sp] = {"fn": fn, "state": state, "x": x, "y": y, "mem": memory_per_device(fn), "times": [],
                    "ops": {k: coll[k]["ops"] for k in KINDS}, "wire": {k: coll[k]["wire_bytes"] for k in KINDS}}
        for _ in range(2):  # warm up
            runs[sp]["state"], m = fn(runs[sp]["state"], x, y)
            float(m["loss"])
    for _ in range(rounds):
        for sp in (False, True):
            r = runs[sp]
            t0 = time.perf_counter()
            for _ in range(steps):
                r["state"], m = r["fn"](r["state"], r["x"], r["y"])
            float(m["loss"])  # synchronises
            r["times"].append((time.perf_counter() - t0) / steps)
    out = {"shape": shape, "dims": SHAPES[shape], "tensor": t, "data": DEVICES // t}
    for sp in (False, True):
        r = runs[sp]
        out["sp" if sp else "no_sp"] = {"temp": r["mem"]["temp"], "total": r["mem"]["total"], "ops": r["ops"],
                                        "wire_bytes": r["wire"], "step_s_median": statistics.median(r["times"]),
                                        "step_s_rounds": r["times"], "predicted": predicted(shape, t, sp)}
    return out


def summarise(row: dict) -> dict:
    """Ratios SP / no SP: compiled temp and total, measured and predicted step time, and the
    predicted memory saving against the compiled one."""
    a, b = row["no_sp"], row["sp"]
    return {"temp_ratio": b["temp"] / a["temp"], "total_ratio": b["total"] / a["total"],
            "step_ratio": b["step_s_median"] / a["step_s_median"],
            "predicted_step_ratio_cpu": b["predicted"]["step_s"] / a["predicted"]["step_s"],
            "predicted_step_ratio_h100": b["predicted"]["h100_step_s"] / a["predicted"]["h100_step_s"],
            "saving_compiled_mb": (a["total"] - b["total"]) / 1e6,
            "saving_predicted_mb": (a["predicted"]["memory"] - b["predicted"]["memory"]) / 1e6,
            "added_all_gathers": b["ops"]["all-gather"] - a["ops"]["all-gather"],
            "all_reduces_kept": b["ops"]["all-reduce"] == a["ops"]["all-reduce"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/sequence_parallel.json")
    args = ap.parse_args(argv)
    from jaxpar.parallel.mesh import emulate_host_devices

    emulate_host_devices(DEVICES)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rows = []
    print(f"{'shape':<6}{'t':>3}{'temp off':>11}{'temp on':>10}{'ratio':>7}{'step off':>10}{'step on':>9}{'ratio':>7}"
          f"{'pred cpu':>9}{'pred h100':>10}{'saved MB (XLA / pred)':>24}")
    for shape in SHAPES:
        for t in TENSOR:
            row = measure_pair(shape, t, args.steps, args.rounds)
            row["summary"] = s = summarise(row)
            rows.append(row)
            print(f"{shape:<6}{t:>3}{row['no_sp']['temp'] / 1e6:>9.2f}MB{row['sp']['temp'] / 1e6:>8.2f}MB"
                  f"{s['temp_ratio']:>7.3f}{row['no_sp']['step_s_median'] * 1e3:>8.1f}ms"
                  f"{row['sp']['step_s_median'] * 1e3:>7.1f}ms{s['step_ratio']:>7.3f}{s['predicted_step_ratio_cpu']:>9.3f}"
                  f"{s['predicted_step_ratio_h100']:>10.3f}{s['saving_compiled_mb']:>14.2f} / {s['saving_predicted_mb']:.2f}",
                  flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"devices": DEVICES, "steps": args.steps, "rounds": args.rounds, "loadavg": os.getloadavg(),
                   "rows": rows}, fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
