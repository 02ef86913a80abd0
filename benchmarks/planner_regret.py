"""Planner regret on 8 emulated CPU devices: is the planner's pick close to the fastest measured plan?

Plans a small GPT-2 (the model of `planner_accuracy.py`) on `devices=8 device=cpu` and measures,
for real, every candidate the planner returns that fits (the best strategy of each mesh, `--top`
of them) plus the other options on the pick's own mesh (remat selective/full, two microbatches,
vocab and MLP chunks), then reports

    regret = median step time of the planner's pick / best median step time - 1

(target: within 5 %), each candidate's predicted vs measured step time and the rank
correlation. How it measures, so that shared-machine noise hits every candidate alike: one process
compiles every candidate ahead of time (each gets its own mesh over the same 8 devices), runs two
warm-up steps each, then times `--rounds` rounds; a round runs every candidate once, in an order
rotated each round. Per candidate: median and minimum over rounds, and the spread (max/min - 1).

    python benchmarks/planner_regret.py [--rounds 10] [--top 8] [--set model.n_embd=128 ...]
                                        [--out benchmarks/results/planner_regret.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar.parallel.mesh import emulate_host_devices  # noqa: E402

emulate_host_devices(8)  # before JAX initialises; keeps a user's other XLA_FLAGS (setdefault left them 1 device)

# The model of benchmarks/planner_accuracy.py (fp32: XLA:CPU upcasts bf16 matmuls anyway).
MODEL = {"model.n_layer": 4, "model.n_embd": 256, "model.n_head": 8, "model.vocab_size": 2048,
         "model.n_positions": 256, "train.batch_size": 16, "train.seq_len": 128, "precision": "fp32"}
N_DEVICES = 8


def base_config(model: dict):
    from jaxpar import config as C

    return C.validate(C.apply_overrides(C.Config(), {k: str(v) for k, v in model.items()}))


def candidates(cfg, top: int) -> tuple[list, int]:
    """The planner's fitting candidates (pick first), then the pick's mesh with its other options
    -> (estimates, how many came from the planner)."""
    import dataclasses

    from jaxpar.planner.cost import Workload, estimate
    from jaxpar.planner.devices import get_device
    from jaxpar.planner.search import SearchSpace, search

    w = Workload(cfg.model, cfg.train.batch_size, cfg.train.seq_len, cfg.precision)
    dev = get_device("cpu")
    res = search(w, N_DEVICES, dev, dev.memory, SearchSpace(), top_k=top)
    out = list(res.ranked)
    pick = out[0].strategy
    seen = {e.strategy for e in out}
    variants = [dataclasses.replace(pick, remat=r) for r in ("none", "selective", "full")]
    variants += [dataclasses.replace(pick, vocab_chunks=8), dataclasses.replace(pick, mlp_chunks=4)]
    if pick.pipe == 1 and (cfg.train.batch_size // (pick.data * pick.fsdp)) % 2 == 0:
        variants.append(dataclasses.replace(pick, microbatches=2 * pick.microbatches))
    for s in variants:
        if s not in seen:
            e = estimate(w, s, dev, dev.memory)
            if e.fits:
                out.append(e)
                seen.add(s)
    return out, len(res.ranked)


def label(e) -> str:
    s = e.strategy
    out = f"{s.data}×{s.fsdp}×{s.tensor}×{s.pipe} M{s.microbatches}" + (f" R{s.repeats}" if s.repeats > 1 else "")
    out += f" {s.remat}" + (f" vc{s.vocab_chunks}" if s.vocab_chunks > 1 else "")
    out += f" mc{s.mlp_chunks}" if s.mlp_chunks > 1 else ""
    rep = [g for g in s.replicated] if s.fsdp > 1 else []
    return out + (" rep:" + "+".join(rep) if rep else "")


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (no ties expected in float timings)."""
    ra = {i: r for r, i in enumerate(sorted(range(len(a)), key=lambda i: a[i]))}
    rb = {i: r for r, i in enumerate(sorted(range(len(b)), key=lambda i: b[i]))}
    n = len(a)
    return 1 - 6 * sum((ra[i] - rb[i]) ** 2 for i in range(n)) / (n * (n * n - 1)) if n > 1 else 1.0


def regret(measured: list[float], pick: int = 0) -> float:
    """measured[pick] / min(measured) - 1."""
    return measured[pick] / min(measured) - 1


def build(cfg, e):
    """Compile candidate `e` ahead of time -> (run, state, inputs, targets)."""
    import numpy as np

    from jaxpar import config as C
    from jaxpar.models import gpt2
    from jaxpar.parallel.layout import build_layout
    from jaxpar.planner.plan import Plan, plan_to_overrides, summary
    from jaxpar.train import build_trainer

    data = {**summary(e), "devices": N_DEVICES, "model": C.to_dict(cfg)["model"],
            "batch_size": cfg.train.batch_size, "seq_len": cfg.train.seq_len, "precision": cfg.precision}
    run_cfg = C.validate(C.apply_overrides(cfg, plan_to_overrides(Plan(data), N_DEVICES, cfg)))
    tr = build_trainer(build_layout(run_cfg, N_DEVICES))
    state = tr.init_state(gpt2.init_params(run_cfg.model, 0))
    rng = np.random.default_rng(0)
    B, T, V = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    x = tr.put_batch(rng.integers(0, V, (B, T)).astype(np.int32))
    y = tr.put_batch(rng.integers(0, V, (B, T)).astype(np.int32))
    return tr.step_fn.lower(state, x, y).compile(), state, x, y


def measure(cfg, estimates: list, rounds: int) -> tuple[list[list[float]], tuple]:
    """Step times (seconds) of each candidate over `rounds` interleaved rounds, and the load
    average before and after timing. Every candidate is compiled and warmed up first."""
    import jax

    runs = []
    for e in estimates:
        fn, state, x, y = build(cfg, e)
        for _ in range(2):  # warm-up
            state, m = fn(state, x, y)
        jax.block_until_ready(m["loss"])
        runs.append({"fn": fn, "state": state, "x": x, "y": y, "times": []})
    load0 = os.getloadavg()
    for r in range(rounds):
        k = r % len(runs)
        for run in runs[k:] + runs[:k]:  # rotated order: no candidate always runs first
            t0 = time.perf_counter()
            run["state"], m = run["fn"](run["state"], run["x"], run["y"])
            jax.block_until_ready(m["loss"])
            run["times"].append(time.perf_counter() - t0)
    return [run["times"] for run in runs], (load0, os.getloadavg())


def write_json(path: str, obj: dict) -> None:
    """Write a benchmark report (creating its folder) and say where."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=8, help="planner candidates (best strategy per mesh)")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (each runs every candidate once)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="model/batch overrides")
    ap.add_argument("--out", default="benchmarks/results/planner_regret.json")
    args = ap.parse_args(argv)

    import numpy as np

    model = {**MODEL, **dict(kv.split("=", 1) for kv in args.set)}
    cfg = base_config(model)
    cands, n_planner = candidates(cfg, args.top)
    print(f"{len(cands)} candidates on {N_DEVICES} emulated CPU devices; compiling ...", flush=True)
    times, (load0, load1) = measure(cfg, cands, args.rounds)

    rows = []
    print(f"{'#':>2} {'candidate':<34}{'pred s':>9}{'median s':>10}{'min s':>9}{'spread':>8}")
    for i, (e, t) in enumerate(zip(cands, times)):
        rows.append({"label": label(e), "source": "planner" if i < n_planner else "variant of the pick",
                     "strategy": {"mesh": e.strategy.mesh, "microbatches": e.strategy.microbatches,
                                  "repeats": e.strategy.repeats, "remat": e.strategy.remat,
                                  "replicated": list(e.strategy.replicated),
                                  "vocab_chunks": e.strategy.vocab_chunks, "mlp_chunks": e.strategy.mlp_chunks},
                     "predicted_step_s": e.step_time_s, "median_s": float(np.median(t)), "min_s": float(min(t)),
                     "spread": max(t) / min(t) - 1, "times": t})
        r = rows[-1]
        print(f"{i + 1:>2} {r['label']:<34}{r['predicted_step_s']:>9.3f}{r['median_s']:>10.3f}{r['min_s']:>9.3f}"
              f"{100 * r['spread']:>7.0f}%", flush=True)
    med = [r["median_s"] for r in rows]
    best = int(np.argmin(med))
    out = {"model": model, "devices": N_DEVICES, "rounds": args.rounds, "rows": rows,
           "pick": rows[0]["label"], "best_measured": rows[best]["label"],
           "regret": regret(med), "regret_min": regret([r["min_s"] for r in rows]),
           "spearman": spearman([r["predicted_step_s"] for r in rows], med),
           "load_average_before": load0, "load_average_after": load1}
    print(f"planner pick: {out['pick']} ({med[0]:.3f} s); best measured: {out['best_measured']} ({med[best]:.3f} s); "
          f"regret {100 * out['regret']:+.1f}% (target <= 5%; on minimums {100 * out['regret_min']:+.1f}%); "
          f"rank correlation predicted vs measured {out['spearman']:+.2f}; "
          f"load average {load0[0]:.1f} -> {load1[0]:.1f}")
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
