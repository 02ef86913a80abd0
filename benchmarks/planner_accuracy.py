"""Planner cost model vs the compiler, on 8 emulated CPU devices.

For each configuration (mixes of data / fsdp / tensor / pipe, remat on/off, grad accumulation,
circular pipeline, fp32 and bf16) we compile jaxpar's real train step (jaxpar.run.inspection.compile_step,
nothing is executed) and compare
  * predicted per-device memory  vs  compiled.memory_analysis()  (arguments + outputs - aliased + temp)
  * predicted collective bytes   vs  bytes parsed from the optimized HLO (ring wire bytes per device)
Targets: memory within 10 %, bytes within 5 %. Misses are printed, not hidden.

    python benchmarks/planner_accuracy.py [--out benchmarks/results/planner_accuracy.json] [--only 1,2]

Rows 15+ cover remat=selective, operator splitting (train.vocab_chunks / train.mlp_chunks) and
per-group OSDP (sharding.replicate). The regret check is `benchmarks/planner_regret.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from jaxpar.parallel.mesh import emulate_host_devices  # noqa: E402

emulate_host_devices(8)  # before JAX initialises; keeps a user's other XLA_FLAGS (setdefault left them 1 device)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

MODEL = {"model.n_layer": 4, "model.n_embd": 256, "model.n_head": 8, "model.vocab_size": 2048,
         "model.n_positions": 256, "train.batch_size": 16, "train.seq_len": 128}
# (data, fsdp, tensor, pipe), precision, remat, grad_accum, microbatches, repeats
CONFIGS = [
    ((8, 1, 1, 1), "fp32", False, 1, 1, 1),
    ((1, 8, 1, 1), "fp32", False, 1, 1, 1),
    ((2, 2, 2, 1), "fp32", False, 1, 1, 1),
    ((4, 1, 2, 1), "fp32", True, 1, 1, 1),
    ((2, 4, 1, 1), "fp32", False, 2, 1, 1),
    ((1, 1, 8, 1), "fp32", False, 1, 1, 1),
    ((2, 1, 1, 4), "fp32", False, 1, 4, 1),
    ((2, 2, 1, 2), "fp32", True, 1, 2, 1),
    ((4, 1, 1, 2), "fp32", False, 1, 2, 2),
    ((1, 4, 1, 2), "fp32", False, 1, 2, 1),
    ((8, 1, 1, 1), "bf16", False, 1, 1, 1),
    ((2, 4, 1, 1), "bf16", False, 1, 1, 1),
    ((1, 2, 4, 1), "bf16", True, 1, 1, 1),
    ((1, 1, 2, 4), "bf16", False, 1, 4, 1),
    # remat selective, op splitting, per-group OSDP: 7th element = extra options
    ((8, 1, 1, 1), "fp32", "selective", 1, 1, 1),
    ((2, 2, 2, 1), "fp32", "selective", 1, 1, 1),
    ((8, 1, 1, 1), "fp32", False, 1, 1, 1, {"vc": 8}),
    ((8, 1, 1, 1), "fp32", False, 1, 1, 1, {"mc": 4}),
    ((2, 1, 4, 1), "fp32", False, 1, 1, 1, {"vc": 8, "mc": 4}),
    ((2, 4, 1, 1), "fp32", "selective", 1, 1, 1, {"vc": 8, "mc": 4}),
    ((2, 4, 1, 1), "fp32", False, 1, 1, 1, {"rep": ("embed",)}),
    ((1, 8, 1, 1), "fp32", False, 1, 1, 1, {"rep": ("attn", "embed")}),
    # pipeline.gather=layer: fsdp weights gathered per layer inside the stage
    ((1, 4, 1, 2), "fp32", False, 1, 2, 1, {"gather": "layer"}),
    ((2, 2, 1, 2), "bf16", False, 1, 2, 1, {"gather": "layer"}),
    ((2, 2, 1, 2), "fp32", False, 1, 2, 2, {"gather": "layer"}),
    # pipeline.schedule=1f1b (parallel/pipeline_1f1b.py): pipe 2 and 4, M below and above the
    # ring's 2S-1 slots
    ((4, 1, 1, 2), "fp32", False, 1, 2, 1, {"sched": "1f1b"}),
    ((1, 2, 2, 2), "fp32", False, 1, 8, 1, {"sched": "1f1b"}),
    ((2, 1, 1, 4), "fp32", False, 1, 2, 1, {"sched": "1f1b"}),
    ((1, 2, 1, 4), "fp32", False, 1, 8, 1, {"sched": "1f1b"}),
    ((1, 2, 1, 4), "bf16", False, 1, 8, 1, {"sched": "1f1b"}),
    # tensor.sequence_parallel on 4 of the devices (tensor=4), and the same row without it
    ((1, 1, 4, 1), "fp32", "selective", 1, 1, 1, {"sp": True}),
    ((1, 1, 4, 1), "fp32", "selective", 1, 1, 1),
]
KINDS = {"all-reduce": "all-reduce", "all-gather": "all-gather", "reduce-scatter": "reduce-scatter",
         "ppermute": "collective-permute", "all-to-all": "all-to-all"}  # all-to-all: not predicted


def run_one(conf) -> dict:
    from jaxpar import config as C
    from jaxpar.planner.cost import Strategy, Workload, estimate
    from jaxpar.planner.devices import get_device
    from jaxpar.run.inspection import collective_bytes, compile_step, memory_per_device

    (d, f, t, p), prec, remat, accum, mb, reps = conf[:6]
    ex = conf[6] if len(conf) > 6 else {}
    vc, mcn, rep = ex.get("vc", 1), ex.get("mc", 1), tuple(ex.get("rep", ()))
    gather, sp = ex.get("gather", "step"), ex.get("sp", False)
    sched = ex.get("sched", "circular" if reps > 1 else "gpipe")
    remat = {True: "full", False: "none"}.get(remat, remat)
    ov = {**MODEL, "mesh.data": d, "mesh.fsdp": f, "mesh.tensor": t, "mesh.pipe": p, "precision": prec,
          "train.remat": remat, "train.vocab_chunks": vc, "train.mlp_chunks": mcn,
          "sharding.replicate": ",".join(rep), "train.grad_accum": accum, "pipeline.microbatches": mb,
          "pipeline.repeats": reps, "pipeline.schedule": sched, "pipeline.gather": gather,
          "tensor.sequence_parallel": str(sp).lower()}
    cfg = C.validate(C.apply_overrides(C.Config(), {k: str(v) for k, v in ov.items()}))
    t0 = time.perf_counter()
    import jax

    compiled, _ = compile_step(cfg, devices=jax.devices()[:d * f * t * p])  # a row may use fewer than 8
    secs = time.perf_counter() - t0
    mem = memory_per_device(compiled)
    coll = collective_bytes(compiled.as_text())
    M = mb if p > 1 else accum
    s = Strategy(d, f, t, p, M, reps, remat, rep, vc, mcn, gather=gather, schedule=sched, seq_parallel=sp)
    e = estimate(Workload(cfg.model, cfg.train.batch_size, cfg.train.seq_len, prec), s, get_device("cpu"))
    measured_bytes = coll["total_wire_bytes"]
    pred_bytes = sum(e.comm_bytes.values())
    return {
        "mesh": {"data": d, "fsdp": f, "tensor": t, "pipe": p}, "precision": prec, "remat": remat,
        "vocab_chunks": vc, "mlp_chunks": mcn, "replicate": list(rep), "gather": gather, "schedule": sched,
        "sequence_parallel": sp, "temp_measured": mem["temp"],
        "grad_accum": accum, "microbatches": mb, "repeats": reps, "compile_s": round(secs, 1),
        "memory_measured": mem["total"], "memory_predicted": int(e.memory["total"]),
        "memory_err": e.memory["total"] / mem["total"] - 1,
        "memory_breakdown_predicted": {k: int(v) for k, v in e.memory.items()},
        "memory_breakdown_measured": mem,
        "bytes_measured": measured_bytes, "bytes_predicted": pred_bytes,
        "bytes_err": (pred_bytes / measured_bytes - 1) if measured_bytes else (0.0 if pred_bytes == 0 else None),
        "bytes_by_kind_measured": {k: coll[v]["wire_bytes"] for k, v in KINDS.items()},
        "bytes_by_kind_predicted": dict(e.comm_bytes),
    }


def label(r: dict) -> str:
    m = r["mesh"]
    s = f"{m['data']}×{m['fsdp']}×{m['tensor']}×{m['pipe']} {r['precision']}"
    s += {"full": " remat", "selective": " sel"}.get(r["remat"], "")
    s += f" vc{r['vocab_chunks']}" if r.get("vocab_chunks", 1) > 1 else ""
    s += f" mc{r['mlp_chunks']}" if r.get("mlp_chunks", 1) > 1 else ""
    s += " rep:" + "+".join(r["replicate"]) if r.get("replicate") else ""
    s += f" acc{r['grad_accum']}" if r["grad_accum"] > 1 else ""
    s += f" M{r['microbatches']}" if m["pipe"] > 1 else ""
    s += f" R{r['repeats']}" if r["repeats"] > 1 else ""
    s += " gather:layer" if r.get("gather") == "layer" else ""
    s += " 1f1b" if r.get("schedule") == "1f1b" else ""
    s += " sp" if r.get("sequence_parallel") else ""
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/planner_accuracy.json")
    ap.add_argument("--only", default="", help="comma-separated 1-based config indices")
    ap.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)  # child: compile one config
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(CONFIGS[args.one - 1])), flush=True)
        return 0
    idx = [int(i) - 1 for i in args.only.split(",") if i] or range(len(CONFIGS))
    rows = []
    print(f"{'#':>2} {'config':<28}{'mem pred':>11}{'mem XLA':>11}{'err':>8}{'bytes pred':>12}{'bytes HLO':>12}"
          f"{'err':>8}")
    for i in idx:
        # One subprocess per config: a compiler crash (seen for pipe×tensor in bf16) costs one row.
        p = subprocess.run([sys.executable, __file__, "--one", str(i + 1)], check=False, capture_output=True, text=True)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            err = next((ln for ln in reversed(p.stderr.splitlines()) if ln.startswith(("F", "E", "jax", "Error",
                                                                                       "Traceback"))), "")
            print(f"{i + 1:>2} {CONFIGS[i]!s:<28} did not compile (rc {p.returncode}): {err[:120]}", flush=True)
            rows.append({"config": CONFIGS[i], "error": f"rc {p.returncode}: {err[:300]}"})
            continue
        r = json.loads(line[len("RESULT "):])
        rows.append(r)
        be = "n/a" if r["bytes_err"] is None else f"{100 * r['bytes_err']:+.1f}%"
        print(f"{i + 1:>2} {label(r):<28}{r['memory_predicted'] / 2**20:>9.1f}Mi{r['memory_measured'] / 2**20:>9.1f}Mi"
              f"{100 * r['memory_err']:>+7.1f}%{r['bytes_predicted'] / 2**20:>10.2f}Mi"
              f"{r['bytes_measured'] / 2**20:>10.2f}Mi{be:>8}", flush=True)
    ok = [r for r in rows if "error" not in r]
    mem_ok = sum(abs(r["memory_err"]) <= 0.10 for r in ok)
    byt_ok = sum(r["bytes_err"] is not None and abs(r["bytes_err"]) <= 0.05 for r in ok)
    print(f"memory within 10%: {mem_ok}/{len(ok)}; collective bytes within 5%: {byt_ok}/{len(ok)}; "
          f"did not compile: {len(rows) - len(ok)}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"model": MODEL, "rows": rows, "memory_within_10pct": mem_ok, "bytes_within_5pct": byt_ok}, fh,
                  indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
