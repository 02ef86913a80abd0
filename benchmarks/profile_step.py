"""Thunk census of one jaxpar train step on XLA:CPU: how many thunks run, on which threads, for how long.

The census behind benchmarks/README.md's CPU step profile, as a script: the real
`build_trainer` step of a `single_device.py` configuration, `keep_freed_memory()` first (as the
CLI), untimed warm-up, then

  * untraced: median process CPU time and wall time per synchronised step (`--rounds`);
  * traced (`jax.profiler`, Python tracer off, `--steps` steps): every thunk the XLA:CPU runtime
    executed, joined with the compiled HLO by instruction name.

What counts as a thunk: an "X" (complete) event on any thread (the thunk executor starts on
the PjRt client thread that runs the executable and hands ready thunks to the `XLAEigen` pool) named like an HLO instruction (`ynn_fusion.25`, `dot.81`), other than
`while` (a scan's loop, whose body thunks count themselves). Not thunks: runtime spans
(`ThunkExecutor::Execute`, `SlinkyThreadPool::Await`, ...), completion markers (`end: <name>`)
and pool records (`ThreadpoolListener::StartRegion` counts the tasks thunks hand to the pool).
Tracing itself costs ~20-30 us per event, so summed thunk time exceeds the untraced step: read
its shares, not its total.

    python benchmarks/profile_step.py --configs small --precisions fp32,bf16 --out /tmp/prof.json
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

POOL_TASK = "ThreadpoolListener::StartRegion"
HLO_NAME = re.compile(r"^[A-Za-z_][\w.\-]*$")  # an HLO instruction name: no '::', no spaces


def kind_of(name: str) -> str:
    """`ynn_fusion.25` -> `ynn_fusion`: one bucket per HLO instruction kind."""
    return re.sub(r"\.\d+$", "", name)


def census(events: list[dict], thread_names: dict, n_steps: int) -> dict:
    """Per-step thunk figures from perfetto trace events (see the module docstring).

    events: trace "X" events ({name, pid, tid, ts, dur} in us); thread_names: (pid, tid) -> name."""
    per_thread_n: collections.Counter = collections.Counter()
    per_thread_us: collections.Counter = collections.Counter()
    kind_n: collections.Counter = collections.Counter()
    kind_us: collections.Counter = collections.Counter()
    name_us: collections.Counter = collections.Counter()
    pool_tasks = while_n = 0
    for e in events:
        thread = thread_names.get((e["pid"], e["tid"]), str(e["tid"]))
        name = e["name"]
        if name == POOL_TASK:
            pool_tasks += 1
        if not HLO_NAME.match(name):
            continue
        if kind_of(name) == "while":  # a scan: its body's thunks are counted themselves
            while_n += 1
            continue
        per_thread_n[thread] += 1
        per_thread_us[thread] += e["dur"]
        kind_n[kind_of(name)] += 1
        kind_us[kind_of(name)] += e["dur"]
        name_us[name] += e["dur"]
    total_us = sum(kind_us.values())
    return {
        "thunks_per_step": sum(per_thread_n.values()) / n_steps,
        "thunk_ms_per_step": total_us / n_steps / 1e3,
        "while_thunks_per_step": while_n / n_steps,
        "pool_tasks_per_step": pool_tasks / n_steps,
        # busiest first; names end in a random id: only the pool/client prefix means anything
        "threads": [{"thread": re.sub(r"/-?\d+$", "", t), "thunks_per_step": per_thread_n[t] / n_steps,
                     "ms_per_step": per_thread_us[t] / n_steps / 1e3}
                    for t in sorted(per_thread_n, key=lambda t: -per_thread_us[t])],
        "kinds": [{"kind": k, "per_step": kind_n[k] / n_steps, "ms_per_step": kind_us[k] / n_steps / 1e3,
                   "share": kind_us[k] / total_us if total_us else 0.0} for k, _ in kind_us.most_common()],
        "top": [{"name": k, "ms_per_step": v / n_steps / 1e3} for k, v in name_us.most_common(15)],
    }


def load_trace(log_dir: str) -> tuple[list[dict], dict]:
    path = glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as f:
        trace = json.load(f)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"], names


def hlo_line(hlo_text: str, name: str) -> str:
    """The compiled HLO instruction `name` (shape and operands), or ''."""
    m = re.search(rf"^\s*(?:ROOT )?%?{re.escape(name)} = (.*)$", hlo_text, re.M)
    return m.group(1).split(", metadata=")[0][:200] if m else ""


def profile(name: str, dims, precision: str, rounds: int, steps: int) -> dict:
    import jax
    import numpy as np
    from single_device import config_of

    from jaxpar.models.gpt2 import init_params
    from jaxpar.parallel.layout import build_layout
    from jaxpar.train import build_trainer

    _, _, _, vocab, seq, batch = dims
    cfg = config_of(dims, precision)
    mc = cfg.model
    trainer = build_trainer(build_layout(cfg, 1), devices=jax.devices()[:1])
    toks = np.random.default_rng(0).integers(0, vocab, size=(batch, seq + 1)).astype(np.int32)
    x, y = trainer.put_batch(toks[:, :-1]), trainer.put_batch(toks[:, 1:])
    state = trainer.init_state(init_params(mc, 0))
    step_fn = trainer.step_fn.lower(state, x, y).compile()

    def step():
        nonlocal state
        state, m = step_fn(state, x, y)
        return float(m["loss"])  # synchronises

    for _ in range(2):
        step()
    cpu, wall = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0  # Python events would swamp the trace buffer
    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir, create_perfetto_trace=True, profiler_options=opts)
        for _ in range(steps):
            step()
        jax.profiler.stop_trace()
        events, names = load_trace(log_dir)
    rep = census(events, names, steps)
    hlo = step_fn.as_text()
    for t in rep["top"]:
        t["hlo"] = hlo_line(hlo, t["name"])
    return {"config": name, "precision": precision, "dims": list(dims), "untraced_cpu_median_s": statistics.median(cpu),
            "untraced_wall_median_s": statistics.median(wall), "loadavg": os.getloadavg(), **rep}


def main(argv=None) -> list[dict]:
    from jaxpar.run.host_memory import keep_freed_memory

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="small", help="comma list of single_device.py configurations")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--rounds", type=int, default=10, help="untraced synchronised steps timed")
    p.add_argument("--steps", type=int, default=3, help="traced steps")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    keep_freed_memory()  # before JAX starts, as `jaxpar train`
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from single_device import CONFIGS

    reports = []
    for name in args.configs.split(","):
        for prec in args.precisions.split(","):
            r = profile(name, CONFIGS[name], prec, args.rounds, args.steps)
            reports.append(r)
            print(f"[{name}/{prec}] untraced step: cpu {r['untraced_cpu_median_s'] * 1e3:.1f} ms, wall "
                  f"{r['untraced_wall_median_s'] * 1e3:.1f} ms (load {r['loadavg'][0]:.1f}); traced: "
                  f"{r['thunks_per_step']:.0f} thunks/step summing {r['thunk_ms_per_step']:.1f} ms, "
                  f"{r['while_thunks_per_step']:.0f} while, {r['pool_tasks_per_step']:.0f} pool tasks; per thread "
                  + ", ".join(f"{t['thread']} {t['thunks_per_step']:.0f} ({t['ms_per_step']:.1f} ms)" for t in r["threads"]))
            for k in r["kinds"][:10]:
                print(f"  {k['kind']:<44}{k['per_step']:>7.1f}/step {k['ms_per_step']:>8.2f} ms {k['share']:>6.1%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(reports, f, indent=2)
        print(f"wrote {args.out}")
    return reports


if __name__ == "__main__":
    main()
