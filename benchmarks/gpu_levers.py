"""The GPU speed levers, each measured on and off in one run: one gpu_mfu.py process per lever.

    python benchmarks/gpu_levers.py [--model gpt2-medium] [--batch 8] [--levers base,cublaslt,...]
                                    [--budget 300] [--steps 8] [--out benchmarks/results/gpu_levers.json]

Each lever is jaxpar's default GPU step (`gpu_mfu.py --torch off`) with one thing changed: an XLA
flag (XLA reads XLA_FLAGS once per process, hence a process per lever; a flag set here wins over
jaxpar's GPU defaults, jaxpar/run/xla_flags.py) or a train setting. `base` runs first and, budget
permitting, again last: the drift between the two bounds what a lever's ratio can claim. A lever
is compared by MFU (a batch lever changes the step's size): `vs_base` = lever MFU / first base
MFU, above 1 faster. A lever that fails (this jaxlib rejects its flag, out of memory) is a row with
its last error line. No lever starts once the budget left is below the slowest lever so far.
Without a GPU it refuses: one line, exit 2 (tests/bench/test_bench_gpu_levers.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_mfu

from gpu_mfu import start_gpu, write_json  # noqa: E402

from jaxpar.run import xla_flags  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# jaxpar's boolean overlap flags (xla_flags.GPU_FLAGS), each set false by `no_overlap`
OVERLAP = tuple(f.split("=")[0] for f in xla_flags.GPU_FLAGS if f.endswith("=true"))

# name -> (what it changes, XLA flags it sets, gpu_mfu.py arguments it adds)
LEVERS = {
    "base": ("jaxpar's GPU defaults", (), ()),
    "cublaslt": ("matmuls through cuBLASLt, whose epilogues can take the bias add and GELU",
                 ("--xla_gpu_enable_cublaslt=true",), ()),
    "triton_gemm": ("Triton gemm fusions on (jaxpar sets them off)", ("--xla_gpu_enable_triton_gemm=true",), ()),
    "no_overlap": ("the collective-overlap flags off", tuple(f"{f}=false" for f in OVERLAP), ()),
    "no_cuda_graphs": ("no command buffers (CUDA graphs)", ("--xla_gpu_enable_command_buffer=",), ()),
    "vocab_chunks4": ("logits + loss in 4 token chunks (train.vocab_chunks=4)", (), ("--vocab-chunks", "4")),
    "remat_selective": ("train.remat=selective (rolled layer scan)", (), ("--remat", "selective")),
    "batch2x": ("twice the batch", (), ()),  # the batch is filled in by command()
}
DEFAULT = "base,cublaslt,vocab_chunks4,batch2x,no_overlap"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-medium")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--levers", default=DEFAULT, help=f"comma list of {', '.join(LEVERS)}")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget", type=float, default=300.0, help="seconds for the whole sweep")
    p.add_argument("--out", default=os.path.join(HERE, "results", "gpu_levers.json"))
    return p.parse_args(argv)


def chosen(args) -> list[str]:
    """The levers asked for, base first; an unknown name is one `error:` line and exit 2."""
    names = [n for n in args.levers.split(",") if n]
    unknown = [n for n in names if n not in LEVERS]
    if unknown:
        print(f"error: --levers {','.join(unknown)}: no such lever (levers: {', '.join(LEVERS)})", file=sys.stderr)
        raise SystemExit(2)
    return ["base"] + [n for n in names if n != "base"]


def command(lever: str, args, out: str) -> list[str]:
    """The gpu_mfu.py command line that measures `lever`, jaxpar's step alone."""
    batch = 2 * args.batch if lever == "batch2x" else args.batch
    return [sys.executable, os.path.join(HERE, "gpu_mfu.py"), "--torch", "off", "--models", args.model,
            "--batch", str(batch), "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--out", out, *LEVERS[lever][2]]


def lever_env(lever: str, env: dict[str, str]) -> dict[str, str]:
    """`env` with the lever's XLA flags in XLA_FLAGS (replacing any of the same name)."""
    return {**env, "XLA_FLAGS": xla_flags.merge_flags(env.get("XLA_FLAGS", ""), LEVERS[lever][1], override=True)}


def run_one(lever: str, args, timeout: float) -> dict:
    """One lever's gpu_mfu.py row, with the seconds the process took; on failure its last error line."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        t0 = time.perf_counter()
        try:
            r = subprocess.run(command(lever, args, out), env=lever_env(lever, dict(os.environ)),
                               capture_output=True, text=True, timeout=timeout)
            err = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1] if r.returncode else ""
        except subprocess.TimeoutExpired:
            err = f"timed out after {timeout:.0f} s"
        row = {"lever": lever, "what": LEVERS[lever][0], "seconds": time.perf_counter() - t0}
        if err or not os.path.exists(out):
            return {**row, "error": err or "no result written"}
        with open(out) as f:
            rep = json.load(f)
        return {**row, "device": rep["device"], "xla_flags": rep["xla_flags"], **rep["rows"][0]}


def sweep(args, run=run_one, clock=time.monotonic) -> list[dict]:
    """base, the levers, base again, while the budget lasts."""
    names = chosen(args)
    start, slowest, rows = clock(), 0.0, []
    for lever in [*names, "base"]:
        left = args.budget - (clock() - start)
        if left < slowest or left <= 0:
            print(f"{lever}: not run ({left:.0f} s of the budget left, the slowest lever took {slowest:.0f} s)")
            continue
        row = run(lever, args, left)
        slowest = max(slowest, row["seconds"])
        rows.append(row)
        base = rows[0].get("mfu")
        if "error" in row:
            print(f"{lever:<16} failed: {row['error']}", flush=True)
            continue
        if base:
            row["vs_base"] = row["mfu"] / base
        print(f"{lever:<16} B={row['batch']:<3} {row['median_step_s'] * 1e3:7.1f} ms/step  MFU {100 * row['mfu']:5.1f}%"
              f"  x{row.get('vs_base', float('nan')):.3f} of base  ({row['seconds']:.0f} s)", flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    chosen(args)
    if not xla_flags.has_nvidia_gpu():
        start_gpu("gpu_levers.py", "sweeps the GPU speed levers")  # its one-line refusal; JAX not started
        return 2
    rows = sweep(args)
    bases = [r for r in rows if r["lever"] == "base" and "mfu" in r]
    report = {"model": args.model, "batch": args.batch, "seq": args.seq, "steps": args.steps, "rows": rows,
              "base_drift": bases[-1]["mfu"] / bases[0]["mfu"] - 1 if len(bases) == 2 else None,
              "device": next((r.get("device") for r in rows if r.get("device")), None)}
    if report["base_drift"] is not None:
        print(f"base first vs last: {100 * report['base_drift']:+.1f}% MFU (a lever within this is noise)")
    write_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
