"""Scaling view: predicted throughput and MFU vs device count (matplotlib, headless)."""

from __future__ import annotations


def plot_sweep(points: list[dict], path: str, title: str = "") -> str:
    """points: [{"devices", "tokens_per_s", "mfu"}, ...] -> PNG at `path` (log2 device axis)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers / CI
    import matplotlib.pyplot as plt

    n = [p["devices"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(n, [p["tokens_per_s"] for p in points], "o-", color="tab:blue", label="tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices")
    ax.set_ylabel("predicted tokens/s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(n, [100 * p["mfu"] for p in points], "s--", color="tab:red", label="MFU")
    ax2.set_ylabel("predicted MFU (%)", color="tab:red")
    ax2.set_ylim(0, 100)
    for p in points:  # annotate each point with its mesh d×f×t×p
        m = p.get("mesh")
        if m:
            ax.annotate("×".join(str(m[k]) for k in ("data", "fsdp", "tensor", "pipe")),
                        (p["devices"], p["tokens_per_s"]), fontsize=6, textcoords="offset points", xytext=(0, 5))
    ax.set_title(title or "planner: predicted scaling")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
