"""`jaxpar plot run=DIR`: loss (train and val) and tokens/s against step, from metrics.jsonl."""

from __future__ import annotations

import json
import os

from gpt2common.writes import refused_write
from jaxpar.config import ConfigError
from jaxpar.run.metrics import METRICS_FILE


def png_path(run: str, out: str | None) -> str:
    """Where the PNG goes: out= (a .png file in an existing folder, or a folder: <out>/curves.png),
    default <run>/curves.png (out= given empty too, as --help says). Checked before anything is read or drawn."""
    if not out:
        return os.path.join(run, "curves.png")
    if os.path.isdir(out):
        return os.path.join(out, "curves.png")
    if not out.lower().endswith(".png"):
        raise ConfigError(f"out={out!r} must name a .png file or a folder")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise ConfigError(f"out={out!r}: folder {folder!r} does not exist")
    return out


def plot_run(run: str, out: str | None = None) -> str:
    out = png_path(run, out)
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
    try:
        with refused_write(out):  # a full disk: one line, exit 4
            fig.savefig(out, dpi=100)
    except OSError as e:  # what refused_write leaves: no permission, a folder that takes no files (/proc)
        raise ConfigError(f"out={out!r} cannot be written ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return out
