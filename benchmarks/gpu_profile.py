"""Where one GPU train step's time goes: a jax.profiler trace of the real step, summed per kernel.

    python benchmarks/gpu_profile.py [--model gpt2-medium] [--batch 8] [--seq 1024] [--steps 3]
                                     [--out benchmarks/results/gpu_profile.json]

Builds the step exactly as benchmarks/gpu_mfu.py does, warms it up, traces `--steps` steps
(`jax.profiler.trace(..., create_perfetto_trace=True)`) and reads the Chrome-format trace back:
every complete event on the device's streams, summed by kernel name and by class (matmul,
attention, copies, the rest), per step, next to the step's wall time; then joined to the compiled
step's HLO (benchmarks/hlo_join.py): each kernel's instruction (the trace's `hlo_op`), its bytes,
GB/s and share of the memory's peak, and the line of jaxpar's source that traced it, with the
time summed per source line. Kernel busy time below the wall time is time the GPU waited (host,
launches, synchronisation). On a machine without a GPU it refuses: one line, exit 2
(tests/bench/test_bench_gpu_mfu.py tests the reader on a synthetic trace, tests/bench/
test_bench_hlo_join.py the join on a CPU trace of the real step).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_mfu, also under runpy (gpu_session.sh)

import hlo_join  # noqa: E402
from gpu_mfu import preset_step, start_gpu, write_json  # noqa: E402

# kernel-name fragments -> class; the first match wins (cuBLAS/CUTLASS gemms, cuDNN attention)
CLASSES = (("attention", ("fmha", "flash", "cudnn", "sdpa")),
           ("matmul", ("gemm", "cutlass", "xmma", "sm90_", "nvjet", "cublas", "dot")),
           ("copy", ("memcpy", "memset", "copy")))


def kernel_class(name: str) -> str:
    n = name.lower()
    return next((c for c, keys in CLASSES if any(k in n for k in keys)), "other")


def read_trace(logdir: str) -> dict:
    """The Chrome-format trace `jax.profiler.trace(logdir, create_perfetto_trace=True)` wrote."""
    path = sorted(glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        return json.load(f)


def device_threads(trace: dict) -> dict[tuple, str]:
    """{(pid, tid): thread name} of the '/device:GPU:*' processes. Their 'Stream #..' threads hold
    the kernels (an 'XLA Ops' thread, where a trace has one, the same time again)."""
    ev = trace["traceEvents"]
    gpu = {e["pid"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"
           and "/device:GPU" in e["args"]["name"]}
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in ev
            if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] in gpu}


def complete_events(trace: dict, threads: dict[tuple, str], which: str) -> list[dict]:
    """The complete ('X') events on the threads whose name contains `which`."""
    keep = {k for k, n in threads.items() if which in n}
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and (e["pid"], e.get("tid")) in keep and "dur" in e]


def summarize(events: list[dict], steps: int, top: int = 40) -> dict:
    """Per-step milliseconds by name and by class; busy = the union of the events' intervals."""
    by_name, by_class = collections.Counter(), collections.Counter()
    for e in events:
        by_name[e["name"]] += e["dur"] / 1e3 / steps
        by_class[kernel_class(e["name"])] += e["dur"] / 1e3 / steps
    busy, end = 0.0, -math.inf
    for s, d in sorted((e["ts"], e["dur"]) for e in events):
        if s + d > end:
            busy += s + d - max(s, end)
            end = s + d
    return {"busy_ms": busy / 1e3 / steps, "by_class_ms": dict(by_class.most_common()),
            "top_ms": dict(by_name.most_common(top)), "events_per_step": len(events) / steps}


# memory bandwidth by device kind (TB/s, vendor figures; the first fragment found wins)
HBM_TBPS = (("H200", 4.8), ("H100 PCIe", 2.0), ("H100", 3.35), ("A100", 2.0))


def hbm_tbps(device_kind: str) -> float | None:
    return next((tb for frag, tb in HBM_TBPS if frag in device_kind), None)


def times_by_op(events: list[dict], steps: int) -> dict[str, float]:
    """ms per step by HLO instruction: each event's `args["hlo_op"]` where the trace gives it (a
    cuBLAS or cuDNN kernel then counts under its custom-call), else the kernel's own name."""
    out = collections.Counter()
    for e in events:
        out[e.get("args", {}).get("hlo_op") or e["name"]] += e["dur"] / 1e3 / steps
    return dict(out)


def joined(events: list[dict], hlo_text: str, steps: int, hbm: float | None, top: int = 40) -> dict:
    """The kernels' time joined to the compiled step (benchmarks/hlo_join.py): the `top` slowest
    instructions with bytes, GB/s and source lines; ms per source line; ms the module does not name."""
    rows = hlo_join.join(times_by_op(events, steps), hlo_join.parse_module(hlo_text), hbm)
    return {"rows": rows[:top], "by_source_ms": hlo_join.by_source(rows),
            "unjoined_ms": sum(r["ms"] for r in rows if r["hlo"] is None)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-medium")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--attention", default="auto", choices=("auto", "xla", "cudnn"))
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "gpu_profile.json"))
    args = p.parse_args(argv)
    if not start_gpu("gpu_profile.py", "profiles the GPU step"):
        return 2
    import jax

    _, trainer, state, x, y = preset_step(args.model, args.batch, args.seq, args.attention)
    # compiled once: the steps below run this executable, whose text the kernels are joined to
    step = trainer.step_fn.lower(state, x, y).compile()
    hlo_text = step.as_text()
    for _ in range(3):  # compile and settle
        state, m = step(state, x, y)
        float(m["loss"])
    logdir = tempfile.mkdtemp(prefix="jaxpar_prof_")
    t0 = time.perf_counter()
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        for _ in range(args.steps):
            state, m = step(state, x, y)
        float(m["loss"])
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    trace = read_trace(logdir)
    threads = device_threads(trace)
    streams = complete_events(trace, threads, "Stream")
    kernels = summarize(streams, args.steps)
    device = jax.devices()[0].device_kind
    hlo = joined(streams, hlo_text, args.steps, hbm_tbps(device))
    report = {"device": device, "jax": jax.__version__, "model": args.model, "batch": args.batch,
              "seq": args.seq, "attention": args.attention, "steps": args.steps, "wall_ms": wall,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "threads": sorted(set(threads.values())),
              "hbm_tbps": hbm_tbps(device), "kernels": kernels, "hlo": hlo}
    print(f"{args.model} B={args.batch} T={args.seq} on {device}: wall {wall:.1f} ms/step (traced), "
          f"kernels busy {kernels['busy_ms']:.1f} ms/step ({kernels['events_per_step']:.0f}/step); "
          f"{hlo['unjoined_ms']:.1f} ms/step not named by the step's HLO")
    for c, ms in kernels["by_class_ms"].items():
        print(f"  {c:<10} {ms:8.2f} ms/step")
    print("  by HLO instruction (ms/step, GB/s upper bound, share of HBM peak, source):")
    for r in hlo["rows"][:25]:
        bw = f"{r['gb_per_s']:7.0f} {100 * r['hbm_share']:4.0f}%" if r.get("hbm_share") is not None else " " * 13
        what = (r.get("sources") or [""])[0] if r["hlo"] else "(not in the module)"
        print(f"  {r['ms']:8.2f}  {r['key'][:34]:<34} {bw}  {r.get('opcode', ''):<12} {what[:60]}")
    print("  by source line:")
    for src, ms in list(hlo["by_source_ms"].items())[:15]:
        print(f"  {ms:8.2f}  {src}")
    write_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
