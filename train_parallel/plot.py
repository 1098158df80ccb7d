"""Plots prunus writes as PNG, and the layout rules every one of them follows.

Loss curves (training loss per step, validation loss at each evaluation) live here; the helpers
below are shared with the compression report and the benchmarks (stages above this one):
- tick labels show plain values, never an offset ("+2.871") a reader has to add back;
- an axis spans at least a stated minimum, so a change of 0.04% does not fill the plot;
- point labels are placed where they stay inside the axes and clear of each other;
- the figure is laid out by matplotlib's constrained layout, so the axes use the whole image.
"""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import ScalarFormatter  # noqa: E402

from prunus.artifacts.atomic import atomic_write_bytes  # noqa: E402


def plain_ticks(ax) -> None:
    """Tick labels as plain values on both axes: no offset text, no scientific notation."""
    for axis in (ax.xaxis, ax.yaxis):
        formatter = axis.get_major_formatter()
        if isinstance(formatter, ScalarFormatter):
            formatter.set_useOffset(False)
            formatter.set_scientific(False)


def span_limits(values, min_span: float, pad: float = 0.12) -> tuple[float, float]:
    """Axis limits around ``values`` with ``pad`` of the span on each side, spanning at least ``min_span``."""
    lo, hi = min(values), max(values)
    span = max((hi - lo) * (1 + 2 * pad), min_span)
    mid = (lo + hi) / 2
    return mid - span / 2, mid + span / 2


# Offsets (points) tried in turn for a point's label: right-above first, then around the point.
LABEL_OFFSETS = [(6, 6), (6, -14), (-14, 6), (-14, -14), (6, 18), (-14, 18), (6, -26), (-14, -26),
                 (18, -4), (-26, -4), (18, 14), (-26, 14)]


def place_point_labels(fig, ax, xs, ys, labels, fontsize: float = 9) -> list:
    """Annotate each point with its label at the first offset that keeps the label inside the axes and
    clear of every label placed before it (and of the axes' other texts); returns the annotations."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    taken = []
    out = []
    for x, y, text in zip(xs, ys, labels):
        ann = None
        for dx, dy in LABEL_OFFSETS:
            if ann is not None:
                ann.remove()
            ann = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=fontsize)
            ext = ann.get_window_extent(renderer)
            inside = (ext.x0 >= box.x0 + 1 and ext.x1 <= box.x1 - 1 and ext.y0 >= box.y0 + 1 and ext.y1 <= box.y1 - 1)
            if inside and not any(ext.overlaps(t) for t in taken):
                break
        taken.append(ann.get_window_extent(renderer))
        out.append(ann)
    return out


def fit_text(fig, ax, text, min_size: float = 5.0) -> None:
    """Shrink ``text`` (placed in ``ax``) until it lies inside the axes, down to ``min_size`` points."""
    renderer = fig.canvas.get_renderer()
    while text.get_fontsize() > min_size:
        fig.canvas.draw()
        box, frame = text.get_window_extent(renderer), ax.get_window_extent(renderer)
        if box.x1 <= frame.x1 and box.y0 >= frame.y0 and box.x0 >= frame.x0 and box.y1 <= frame.y1:
            return
        text.set_fontsize(text.get_fontsize() - 0.5)


def key_text(fig, ax, lines: list[str], fontsize: float = 8.0):
    """A key (one line per entry) in its own axes, top left, shrunk until it fits; the axes' frame is hidden."""
    ax.set_axis_off()
    text = ax.text(0, 1, "\n".join(lines), va="top", ha="left", fontsize=fontsize, family="monospace",
                   transform=ax.transAxes)
    fit_text(fig, ax, text)
    return text


def figure_png(fig) -> bytes:
    """The figure as PNG bytes (the figure is closed)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def loss_figure(records: list[dict], title: str = "prunus train"):
    """The loss curves of a run's metrics records, as a matplotlib Figure."""
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120, layout="constrained")
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", markersize=3)
        ax.set_title(f"{title}: final validation {val[-1][1]:.3f} nats/token", fontsize=10)
    else:
        ax.set_title(title, fontsize=10)
    losses = [v for _, v in train + val]
    if losses:
        ax.set_ylim(*span_limits(losses, min_span=0.05, pad=0.05))
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    plain_ticks(ax)
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend(loc="upper right")
    return fig


def plot_loss_curves(records: list[dict], path: str | Path, title: str = "prunus train") -> Path:
    """Write the loss curves of ``records`` to ``path`` (PNG, atomically)."""
    atomic_write_bytes(path, figure_png(loss_figure(records, title)))
    return Path(path)
