"""Every plot prunus writes reads at a glance: its layout checked on the rendered figure.

For each kind of compression report (int8 weight-only, W8A8, fp8, unstructured and structured
pruning, distillation, a recipe of several passes) and the training loss plot: every text
inside the figure, point labels and the key inside their axes, no two texts overlapping, no
offset text ("+2.871") on either axis, a minimum span on the quality axis, and an x axis that
moves for unstructured pruning.
"""

from __future__ import annotations

import itertools

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from prunus.compress.report import MIN_SPAN_PERCENT, plot_size, report_figure, report_files  # noqa: E402
from prunus.train_parallel.plot import loss_figure, span_limits  # noqa: E402

PARAMS, BYTES, BPB = 3_311_872, 13_250_000, 2.8716


def row(name, bpb=BPB, params=PARAMS, nonzero=None, size=BYTES):
    return {"pass": name, "val_loss": bpb * 0.69, "val_bpb": bpb, "val_tokens": 4096, "bpb_change": bpb / BPB - 1,
            "agreement": 1.0, "params": params, "nonzero_params": params if nonzero is None else nonzero, "bytes": size}


INT8 = "quantize(scheme=int8-weight-only)"
REPORTS = {
    # the change of 0.00016 bits per byte (+0.006%) that once filled the whole plot under an offset
    "int8-weight-only": [row("input"), row(INT8, BPB + 0.00016, size=3_860_000)],
    "w8a8": [row("input"), row("smoothquant(alpha=0.5)", BPB + 0.00002),
             row("quantize(scheme=w8a8-dynamic, granularity=per_channel)", BPB + 0.0002, size=3_860_000)],
    "fp8": [row("input"), row("quantize(scheme=fp8-weight-only, granularity=per_channel, exclude=[output, blocks.3])",
                              BPB * 1.0022, size=4_400_000)],
    "prune-unstructured": [row("input"), row("prune(method=wanda, sparsity=0.5, scope=layer)", BPB * 1.012,
                                             nonzero=1_950_000)],
    "prune-2:4": [row("input"), row("prune(method=2:4)", BPB * 1.036, nonzero=1_950_000)],
    "prune-structured": [row("input"), row("prune_structured(target=heads, amount=0.25)", BPB * 1.036,
                                           params=3_120_000, size=12_480_000)],
    "distill": [row("input"), row("distill(student=keep-every:2,width:1.1)", BPB * 0.71, params=1_483_977,
                                  size=5_940_000)],
    "recipe": [row("input"), row("prune(method=wanda, sparsity=0.5, scope=layer)", BPB * 1.012, nonzero=1_950_000),
               row("prune_structured(target=channels, amount=0.25)", BPB * 1.02, params=2_720_000,
                   nonzero=1_600_000, size=10_880_000),
               row("distill(lr=0.001)", BPB * 1.005, params=2_720_000, nonzero=2_720_000, size=10_880_000),
               row(INT8, BPB * 1.0051, params=2_720_000, nonzero=2_700_000, size=3_200_000)],
    # the same point twice: labels must still not overlap
    "no-op": [row("input"), row("smoothquant(alpha=0.5)"), row("smoothquant(alpha=0.8)")],
}


def report(kind):
    return {"source": "runs/demo/model", "rows": REPORTS[kind], "seq_len": 256, "corpus": "builtin"}


def texts(fig) -> list[Text]:
    """The texts a reader sees: every visible, non-empty text, tick labels only for ticks within the view
    (matplotlib keeps label artists for ticks just outside it, which it does not draw)."""
    hidden = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo - 1e-12 * max(1, abs(hi)) <= tick.get_loc() <= hi + 1e-12 * max(1, abs(hi)) \
                        or not axis.get_visible() or not ax.axison:
                    hidden.update({id(tick.label1), id(tick.label2)})
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in hidden]


def check_layout(fig) -> None:
    """Every text inside the figure; texts placed in an axes (point labels, keys) inside that axes; no two
    texts overlapping; no offset text on any axis."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    page = fig.bbox
    boxes = []
    for t in texts(fig):
        box = t.get_window_extent(renderer)
        assert page.x0 - 0.5 <= box.x0 and box.x1 <= page.x1 + 0.5 and page.y0 - 0.5 <= box.y0 \
            and box.y1 <= page.y1 + 0.5, f"{t.get_text()!r} runs off the figure: {box} vs {page}"
        boxes.append((t.get_text(), box))
    for ax in fig.axes:
        frame = ax.get_window_extent(renderer)
        for t in ax.texts:
            box = t.get_window_extent(renderer)
            assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, \
                f"{t.get_text()!r} lies outside its axes: {box} vs {frame}"
        for axis in (ax.xaxis, ax.yaxis):
            assert axis.get_offset_text().get_text() == "", f"offset on an axis: {axis.get_offset_text().get_text()}"
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        assert not box_a.overlaps(box_b), f"{a!r} overlaps {b!r}"


@pytest.mark.parametrize("kind", REPORTS)
def test_report_plot_layout(kind):
    fig = report_figure(report(kind))
    try:
        check_layout(fig)
        ax = fig.axes[0]
        lo, hi = ax.get_ylim()
        assert hi - lo >= MIN_SPAN_PERCENT - 1e-9, "a change of hundredths of a percent must not fill the plot"
        ys = [100 * r["bpb_change"] for r in REPORTS[kind]]
        assert lo < min(ys) and max(ys) < hi
        assert len(ax.texts) == len(REPORTS[kind])  # one numbered label per row
        # the axes use most of the figure: no plot squeezed into a corner by long labels
        assert ax.get_position().width > 0.45 and ax.get_position().height > 0.7
    finally:
        plt.close(fig)


@pytest.mark.parametrize("kind", ["prune-unstructured", "prune-2:4", "recipe"])
def test_unstructured_pruning_moves_along_x(kind):
    """Masking half the weights leaves the file size alone: the plot's x must be a size that changes."""
    xs, label = plot_size(report(kind))
    assert xs[1] < 0.7 * xs[0] and "non-zero" in label


def test_dense_reports_plot_the_file_size():
    xs, label = plot_size(report("int8-weight-only"))
    assert label == "model.safetensors (MB)" and xs == [13.25, 3.86]


def test_report_files_hold_a_png():
    assert report_files(report("recipe"))["report.png"].startswith(b"\x89PNG")


def test_span_limits():
    assert span_limits([0.0, 0.04], min_span=1.0) == pytest.approx((-0.48, 0.52))
    lo, hi = span_limits([0.0, -29.4], min_span=1.0)
    assert lo < -29.4 and hi > 0 and hi - lo == pytest.approx(29.4 * 1.24)


@pytest.mark.parametrize("records", [
    [{"step": s, "loss": 5.6 - 0.01 * s} for s in range(1, 241)] +
    [{"step": s, "val_loss": 4.0 - 0.002 * s, "val_bpb": 2.9} for s in (80, 160, 240)],
    [{"step": s, "loss": 2.8716 + 1e-5 * (s % 3)} for s in range(1, 21)],  # a flat run: no offset, a minimum span
    [{"step": 1, "loss": 5.0}],
])
def test_loss_plot_layout(records):
    fig = loss_figure(records, "prunus train")
    try:
        check_layout(fig)
        lo, hi = fig.axes[0].get_ylim()
        assert hi - lo >= 0.05 - 1e-9
    finally:
        plt.close(fig)
