"""`jaxpar plot run=DIR`: loss (train and val) and tokens/s against step, from metrics.jsonl."""

from __future__ import annotations

import json
import os

from jaxpar.config import ConfigError
from jaxpar.run.metrics import METRICS_FILE


def plot_run(run: str, out: str | None = None) -> str:
    path = os.path.join(run, METRICS_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"run={run!r} has no {METRICS_FILE}")
    with open(path, errors="replace") as f:
        lines = [ln for ln in f if ln.strip()]
    if lines and not lines[-1].endswith("\n"):
        try:  # a last line without its newline: a write cut short by kill -9, unless it parses
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
    try:
        recs = [json.loads(ln) for ln in lines]
    except json.JSONDecodeError:
        raise ConfigError(f"{path!r} is corrupt") from None
    if not recs:
        raise ConfigError(f"{path!r} is empty")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in recs]
    ax1.plot(steps, [r["loss"] for r in recs], label="train")
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    if val:
        ax1.plot(*zip(*val), "o-", label="val")
    ax1.set(xlabel="step", ylabel="loss", title="loss")
    ax1.legend()
    ax2.plot(steps, [r["tokens_per_s"] for r in recs])
    ax2.set(xlabel="step", ylabel="tokens/s", title="throughput")
    fig.tight_layout()
    out = out or os.path.join(run, "curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
