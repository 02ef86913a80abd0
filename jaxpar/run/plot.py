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
    try:
        recs = [json.loads(ln) for ln in open(path) if ln.strip()]
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
