"""`torchref compare workers=2,4 [keys]`: the study's comparison, on this machine.

Runs `single` once and every other strategy at each worker count, all on one config (same
weights, data and batches), then writes to `out=` (default runs/compare):
  compare.md    the table (markdown), compare.json (the same rows + the config), compare.png
  <strategy>-w<N>/   each run's directory (metrics.jsonl, summary.json, hf/, logs/)
Columns: tokens/s (median over steps after the first, which pays for warm-up), speed-up vs
single, scaling efficiency (speed-up / N), step time, peak RSS per process, bytes moved per
step per worker and at the server (sent + received), final loss.

`strategies=a,b` restricts the set (single is always run, it is the baseline).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from gpt2common.grammar import ConfigError, parse_kv, setting
from torchref.config import STRATEGY_NAMES, resolve_ref


@dataclass(frozen=True)
class CompareOptions:
    """compare's own keys (`torchref compare --help`); every other key is `torchref train`'s."""

    workers: tuple[int, ...] = setting((2, 4), "worker counts each multi-worker strategy runs at, each >= 2")
    strategies: tuple[str, ...] = setting(STRATEGY_NAMES, "strategies to run; single always runs (the baseline)")
    out: str = setting("runs/compare", "compare.md, compare.json, compare.png and each run's <strategy>-w<N>/")

COLUMNS = [("strategy", "strategy"), ("workers", "N"), ("tokens_per_s", "tokens/s"), ("speedup", "speed-up"),
           ("efficiency", "efficiency"), ("step_time_s", "step time (s)"), ("peak_rss_mb", "peak RSS/proc (MB)"),
           ("worker_bytes_per_step", "bytes/step/worker"), ("server_bytes_per_step", "bytes/step at server"),
           ("final_loss", "final loss")]


def _ints(raw: str, key: str) -> list[int]:
    try:
        vals = [int(x) for x in raw.replace(" ", "").split(",") if x]
    except ValueError:
        raise ConfigError(f"{key}={raw!r} must be a comma-separated list of integers") from None
    if not vals:
        raise ConfigError(f"{key}={raw!r} is empty")
    return vals


def plan_runs(args: list[str], config_file: str | None = None):
    """Resolve (and so validate) every run before starting any. Returns (out, [(name, cfg, ref)])."""
    items = parse_kv(args)
    workers = _ints(items.pop("workers", ",".join(map(str, CompareOptions.workers))), "workers")
    if any(n < 2 for n in workers):
        raise ConfigError(f"workers={','.join(map(str, workers))}: every worker count must be >= 2")
    strategies = items.pop("strategies", ",".join(CompareOptions.strategies)).split(",")
    for s in strategies:
        if s not in STRATEGY_NAMES:
            raise ConfigError(f"strategies: {s!r} is unknown (choose from {', '.join(STRATEGY_NAMES)})")
    if "strategy" in items:
        raise ConfigError("compare runs every strategy; use strategies=a,b to choose a subset")
    out = items.pop("out", CompareOptions.out)
    rest = [f"{k}={v}" for k, v in items.items()]
    runs = []
    for s in ["single"] + [s for s in STRATEGY_NAMES if s in strategies and s != "single"]:
        for n in [1] if s == "single" else workers:
            name = f"{s}-w{n}"
            cfg, ref = resolve_ref(rest + [f"strategy={s}", f"workers={n}", f"out={os.path.join(out, name)}"],
                                   config_file)
            runs.append((name, cfg, ref))
    return out, runs


def row_of(summary: dict, rows: list[dict]) -> dict:
    timed = rows[1:] or rows
    server = [p for p in summary["procs"] if p["role"] == "server"]
    return {
        "strategy": summary["strategy"], "workers": summary["workers"],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "peak_rss_mb": max(p["peak_rss_bytes"] for p in summary["procs"]) / 2**20,
        "worker_bytes_per_step": statistics.mean(r["bytes_sent"] + r["bytes_received"] for r in rows),
        "server_bytes_per_step": (statistics.mean(r["server_bytes_sent"] + r["server_bytes_received"] for r in rows)
                                  if server else None),
        "final_loss": rows[-1]["loss"], "losses": [r["loss"] for r in rows], "wall_s": summary["wall_s"],
        "param_bytes": summary["param_bytes"], "dir": summary["out"],
    }


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) and abs(v) >= 1e4:
        return f"{v:,}"
    if isinstance(v, float):
        if abs(v) >= 1e4:
            return f"{v:,.0f}"
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r[k]) for k, _ in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    single = next(r for r in rows if r["strategy"] == "single")
    ns = sorted({r["workers"] for r in rows if r["strategy"] != "single"})
    ax1.plot([1] + ns, [single["tokens_per_s"] * n for n in [1] + ns], "k:", label="ideal (linear)")
    for s in STRATEGY_NAMES[1:]:
        pts = sorted((r["workers"], r["tokens_per_s"]) for r in rows if r["strategy"] == s)
        if pts:
            ax1.plot([1] + [p[0] for p in pts], [single["tokens_per_s"]] + [p[1] for p in pts], "o-", label=s)
    ax1.set_xlabel("workers")
    ax1.set_ylabel("tokens/s")
    ax1.set_title("throughput")
    ax1.set_xticks([1] + ns)
    ax1.legend(fontsize=8)
    multi = [r for r in rows if r["strategy"] != "single"]
    labels = [f"{r['strategy']}\nN={r['workers']}" for r in multi]
    x = range(len(multi))
    ax2.bar([i - 0.2 for i in x], [r["worker_bytes_per_step"] / 2**20 for r in multi], 0.4, label="per worker")
    ax2.bar([i + 0.2 for i in x], [(r["server_bytes_per_step"] or 0) / 2**20 for r in multi], 0.4, label="at server")
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(labels, fontsize=6, rotation=45, ha="right")
    ax2.set_ylabel("MiB per step (sent + received)")
    ax2.set_title("communication")
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(args: list[str], config_file: str | None = None) -> dict:
    from gpt2common.data import resolve_data
    from torchref.launch import train

    out, runs = plan_runs(args, config_file)
    Path(out).mkdir(parents=True, exist_ok=True)
    cfg0 = runs[0][1]
    data_dir = resolve_data(cfg0.data, cfg0.tokenizer, out)  # prepare the corpus once for every run
    rows = []
    for name, cfg, ref in runs:
        print(f"== {name}", flush=True)
        s = train(replace(cfg, data=data_dir), ref)
        metrics = [json.loads(x) for x in Path(s["out"], "metrics.jsonl").read_text().splitlines()]
        rows.append(row_of(s, metrics))
    base = rows[0]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["efficiency"] = r["speedup"] / r["workers"]
    t, m = cfg0.train, cfg0.model
    import torch

    wires = ", ".join(sorted({f"{ref.dist_backend}/{ref.device}" for _, _, ref in runs}))  # what the runs used
    title = (f"{cfg0.model_name} (L={m.n_layer}, D={m.n_embd}), batch {t.batch_size} x {t.seq_len} tokens, "
             f"{t.steps} steps; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
             f"torch {torch.__version__}, {wires}")
    md = markdown(rows, f"# torchref compare\n\n{title}\n\nParameters: {base['param_bytes'] // 4:,} "
                        f"(Psi = {base['param_bytes']:,} bytes fp32).")
    paths = {k: os.path.join(out, f"compare.{k}") for k in ("md", "json", "png")}
    Path(paths["md"]).write_text(md)
    Path(paths["json"]).write_text(json.dumps({"title": title, "rows": rows, "config": json.loads(
        Path(runs[0][1].out, "config.json").read_text())}, indent=2))
    plot(rows, paths["png"], title)
    print(md)
    print(json.dumps(paths))
    return {"rows": rows, "paths": paths}


def main(args: list[str], config_file: str | None = None) -> None:
    compare(args, config_file)
