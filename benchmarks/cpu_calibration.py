"""Fit the planner's `cpu` device row (collectives, FLOP/s, memory traffic) to this host.

The `cpu` row describes emulated devices (`--xla_force_host_platform_device_count`) sharing one
host (`shared_host`): its `peak_flops` and `mem_bandwidth` are the host's, split between the
devices. All of it depends on the machine, so it is fitted here, in two steps:

1. Collectives: chains of dependent all-reduces of three sizes over the 8 emulated devices,
   fitted to the ring formula t = 2(n-1)·α + 2(n-1)/n·X/bw -> latency α and bandwidth bw.
2. Compute and traffic: for a set of strategies of two calibration models (n_embd 128 and 384;
   the regret check's model, 256, stays held out) measure the step time
   (`planner_regret.measure`: interleaved rounds, median) and solve, by least squares on
   relative error, measured ≈ a · compute_s + b · traffic_s + exposed communication, where
   compute_s and traffic_s are the model's terms for the current row. This is done for each pair
   of matmul-efficiency knees (knee_rows, knee_cols) on a grid; the pair with the smallest mean
   relative error wins. Fitted row: peak_flops / a, mem_bandwidth / b, those knees, α and bw.

The script prints the fitted row as `device.` overrides and writes JSON; copy the figures into
`jaxpar/planner/devices.py` to recalibrate for another host.

    python benchmarks/cpu_calibration.py [--rounds 8] [--out benchmarks/results/cpu_calibration.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time

from jaxpar.parallel.mesh import emulate_host_devices  # noqa: E402

emulate_host_devices(8)  # before JAX initialises; keeps a user's other XLA_FLAGS (setdefault left them 1 device)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from planner_regret import base_config, label, measure, write_json  # noqa: E402

# Calibration models: narrower and wider than the regret model (n_embd 256), same vocab / batch.
MODELS = [
    {"model.n_layer": 4, "model.n_embd": 128, "model.n_head": 4, "model.vocab_size": 2048,
     "model.n_positions": 128, "train.batch_size": 16, "train.seq_len": 128, "precision": "fp32"},
    {"model.n_layer": 2, "model.n_embd": 384, "model.n_head": 6, "model.vocab_size": 2048,
     "model.n_positions": 128, "train.batch_size": 16, "train.seq_len": 128, "precision": "fp32"},
]
# (data, fsdp, tensor, pipe, microbatches, remat, vocab_chunks, mlp_chunks)
STRATEGIES = [
    (8, 1, 1, 1, 1, "none", 1, 1), (8, 1, 1, 1, 1, "full", 1, 1), (8, 1, 1, 1, 1, "selective", 1, 1),
    (8, 1, 1, 1, 1, "none", 1, 4), (8, 1, 1, 1, 1, "none", 8, 1), (4, 1, 2, 1, 1, "none", 1, 1),
    (1, 8, 1, 1, 1, "none", 1, 1), (4, 1, 1, 2, 2, "none", 1, 1), (2, 1, 4, 1, 1, "full", 1, 1),
    (8, 1, 1, 1, 2, "none", 1, 1),
]
KNEES = (0.0, 32.0, 64.0, 128.0, 256.0)  # grid for knee_rows and knee_cols


def fit(measured: list[float], compute: list[float], traffic: list[float], comm: list[float]) -> tuple[float, float]:
    """Least squares on relative error: min Σ ((a·c + b·x + k) / m - 1)² -> (a, b)."""
    import numpy as np

    A = np.array([[c / m, x / m] for c, x, m in zip(compute, traffic, measured)])
    y = np.array([1 - k / m for k, m in zip(comm, measured)])
    (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
    return float(a), float(b)


def collective_alpha_beta(sizes=(256, 65536, 1 << 20), chain: int = 100) -> tuple[float, float, list]:
    """Ring all-reduce on the emulated devices: time a chain of `chain` dependent psums of each
    size (fp32 elements per device) and fit t = 2(n-1)·α + 2(n-1)/n·X / bw -> (α, bw, points)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("x",))

    def body(a):
        def step(c, _):  # the psum result is identical on every device; mark it varying again
            return jax.lax.pcast(jax.lax.psum(c, "x") / n, "x", to="varying"), None

        return jax.lax.scan(step, a, None, length=chain)[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    points = []
    for size in sizes:
        a = jax.device_put(jnp.ones((n * size,), jnp.float32), NamedSharding(mesh, P("x")))
        f(a).block_until_ready()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            f(a).block_until_ready()
            ts.append((time.perf_counter() - t0) / chain)
        points.append((4 * size, float(np.median(ts))))
    A = np.array([[2 * (n - 1), 2 * (n - 1) / n * x] for x, _ in points])
    (alpha, inv_bw), *_ = np.linalg.lstsq(A, np.array([t for _, t in points]), rcond=None)
    return float(alpha), float(1 / inv_bw), points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/cpu_calibration.json")
    args = ap.parse_args(argv)

    import numpy as np

    from jaxpar.planner.cost import Strategy, Workload, estimate
    from jaxpar.planner.devices import get_device

    alpha, bw, points = collective_alpha_beta()
    print("all-reduce over 8 devices: " + ", ".join(f"{x / 1e3:.0f} KB {t * 1e6:.0f} us" for x, t in points)
          + f" -> latency {alpha * 1e6:.1f} us per hop, bandwidth {bw:.3g} B/s", flush=True)
    dev = dataclasses.replace(get_device("cpu"), latency=alpha, bandwidth=bw, inter_bandwidth=bw)
    measured = []  # (workload, strategy, model, times)
    for model in MODELS:
        cfg = base_config(model)
        w = Workload(cfg.model, cfg.train.batch_size, cfg.train.seq_len, cfg.precision)
        ests = [estimate(w, Strategy(d, f, t, p, mb, 1, remat, (), vc, mc), dev)
                for d, f, t, p, mb, remat, vc, mc in STRATEGIES
                if cfg.model.n_head % t == 0 and cfg.model.n_embd % t == 0 and cfg.model.n_layer >= p]
        print(f"n_embd={cfg.model.n_embd}: {len(ests)} strategies, compiling ...", flush=True)
        times, _ = measure(cfg, ests, args.rounds)
        measured += [(w, e.strategy, model, ts) for e, ts in zip(ests, times)]
    med = [float(np.median(ts)) for *_, ts in measured]

    def rows_for(d):
        return [estimate(w, s, d) for w, s, *_ in measured]

    best = None
    for kr, kc in itertools.product(KNEES, KNEES):
        d = dataclasses.replace(dev, knee_rows=kr, knee_cols=kc)
        es = rows_for(d)
        comm = [e.step_time_s - e.compute_s - e.traffic_s for e in es]
        a, b = fit(med, [e.compute_s for e in es], [e.traffic_s for e in es], comm)
        err = float(np.mean([abs((a * e.compute_s + b * e.traffic_s + k) / m - 1) for e, k, m in zip(es, comm, med)]))
        if a > 0 and b > 0 and (best is None or err < best[0]):
            best = (err, kr, kc, a, b)
    err, kr, kc, a, b = best
    fitted = dataclasses.replace(dev, knee_rows=kr, knee_cols=kc, peak_flops=dev.peak_flops / a,
                                 peak_flops_fp32=dev.peak_flops_fp32 / a, mem_bandwidth=dev.mem_bandwidth / b)
    rows = []
    print(f"{'model':<8}{'strategy':<30}{'measured':>10}{'current':>10}{'fitted':>10}")
    for (_, _, model, ts), m, old, new in zip(measured, med, rows_for(dev), rows_for(fitted)):
        rows.append({"model": model, "label": label(new), "median_s": m, "times": ts,
                     "current_s": old.step_time_s, "fitted_s": new.step_time_s})
        print(f"D={model['model.n_embd']:<6}{label(new):<30}{m:>10.3f}{old.step_time_s:>10.3f}{new.step_time_s:>10.3f}")
    errs = [abs(r["fitted_s"] / r["median_s"] - 1) for r in rows]
    print(f"fit: compute × {a:.3f}, traffic × {b:.3f}, knees {kr:g}/{kc:g}; "
          f"mean |error| {100 * np.mean(errs):.1f}%, max {100 * max(errs):.1f}%")
    print(f"fitted row: device.peak_flops={fitted.peak_flops:.3g} device.peak_flops_fp32={fitted.peak_flops_fp32:.3g} "
          f"device.mem_bandwidth={fitted.mem_bandwidth:.3g} device.knee_rows={kr:g} device.knee_cols={kc:g} "
          f"device.latency={alpha:.3g} device.bandwidth={bw:.3g} device.inter_bandwidth={bw:.3g}")
    out = {"rows": rows, "a": a, "b": b, "peak_flops": fitted.peak_flops, "mem_bandwidth": fitted.mem_bandwidth,
           "knee_rows": kr, "knee_cols": kc, "latency": alpha, "bandwidth": bw, "allreduce_points": points,
           "mean_abs_error": float(np.mean(errs)), "max_abs_error": float(max(errs)), "load_average": os.getloadavg()}
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
