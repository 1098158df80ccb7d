"""The compression report of a generic module: the task's quality (top-1 accuracy for classification, else the
held-out loss), parameters, bytes of the weights and CPU latency per row, as markdown and a plot."""

from __future__ import annotations


def quality(row: dict) -> tuple[str, float]:
    """(label, value) of a row's quality: top-1 accuracy (%) where the task judges it, else the loss."""
    if "val_accuracy" in row:
        return "top-1 accuracy (%)", 100 * row["val_accuracy"]
    return "held-out loss", row["val_loss"]


def render_module_markdown(report: dict) -> str:
    rows = report["rows"]
    label = quality(rows[0])[0]
    head = ["#", "pass", "val loss", label, "params", "MB", *(["latency (ms)"] if "latency_ms" in rows[0] else [])]
    lines = [f"# Compression report: {report['source']}", "",
             f"task {report['task']}, held-out samples of {report['data']}: {rows[0]['val_samples']:,}; latency: "
             f"median CPU forward of one batch, {report.get('threads')} threads", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(rows):
        cells = [str(i), r["pass"], f"{r['val_loss']:.4f}", f"{quality(r)[1]:.2f}", f"{r['params']:,}",
                 f"{r['bytes'] / 1e6:.3f}", *([f"{r['latency_ms']:.2f}"] if "latency_ms" in r else [])]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- row {i} ({r['pass']}): {line}" for i, r in enumerate(rows) for line in r.get("notes", [])]
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def module_figure(report: dict):
    """Quality against the weights' size, one numbered point per row."""
    import matplotlib.pyplot as plt

    from prunus.train_parallel.plot import place_point_labels, plain_ticks, span_limits

    rows = report["rows"]
    xs = [r["bytes"] / 1e6 for r in rows]
    ys = [quality(r)[1] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=110, layout="constrained")
    ax.plot(xs, ys, "-o", color="tab:blue")
    ax.set_xlim(*span_limits(xs, min_span=0.1 * max(xs)))
    ax.set_ylim(*span_limits(ys, min_span=1.0))
    ax.set_xlabel("weights (MB)")
    ax.set_ylabel(quality(rows[0])[0])
    ax.set_title("quality against size, pass by pass: " + ", ".join(f"{i} {r['pass']}" for i, r in enumerate(rows)),
                 fontsize=8, wrap=True)
    plain_ticks(ax)
    ax.grid(alpha=0.3)
    place_point_labels(fig, ax, xs, ys, [str(i) for i in range(len(rows))])
    return fig
