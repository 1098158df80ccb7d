"""Loss curves as a PNG: training loss per step and validation loss at each evaluation."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from prunus.models.atomic import atomic_write_bytes  # noqa: E402


def plot_loss_curves(records: list[dict], path: str | Path, title: str = "prunus train") -> Path:
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", markersize=3)
        ax.set_title(f"{title}: final validation {val[-1][1]:.3f} nats/token")
    else:
        ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return Path(path)
