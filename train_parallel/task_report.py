"""A generic module's held-out report beyond the loss: for classification the confusion matrix, per-class
precision / recall / F1 / support and top-1 accuracy; for regression the mean squared error, mean absolute error
and R² (per target column, averaged, as scikit-learn's ``r2_score`` does). Accumulated batch by batch, so memory
does not grow with the samples scored. :func:`confusion_png` draws the matrix (matplotlib, written atomically).
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from prunus.artifacts.errors import PrunusError
from prunus.data.global_batches import eval_batches
from prunus.data.prefetch import to_device

MAX_PLOT_CLASSES = 200  # a larger matrix is reported as a table only
DPI = 100


def _confusion(out: torch.Tensor, y: torch.Tensor, c: int) -> torch.Tensor:
    if out.ndim != 2 or y.ndim != 1:
        raise PrunusError(f"the module returns {tuple(out.shape)} for targets of {tuple(y.shape)}; a classifier's "
                          "report takes (N, classes) logits and one class a sample")
    pred = out.argmax(dim=1).long().cpu()
    return torch.bincount(y.long().cpu() * c + pred, minlength=c * c).reshape(c, c)


@torch.no_grad()
def module_report(model, task: str, dataset, *, classes: int | None, batch_size: int, max_samples: int,
                  device="cpu", call=None) -> dict:
    """``classification``: ``confusion`` (rows the true class, columns the predicted), ``classes`` scored; else
    ``regression``: ``val_mse``, ``val_mae``, ``val_r2``. Other tasks: {}."""
    if task not in ("classification", "regression"):
        return {}
    call = call or (lambda m, x: m(x))
    model.eval()
    confusion, sums = None, None
    for x, y in eval_batches(dataset, batch_size, max_samples):
        out = call(model, to_device(x, device))
        if task == "classification":
            c = max(classes or 0, out.shape[-1])  # a module may score more classes than the data holds
            part = _confusion(out, y, c)
            confusion = part if confusion is None else confusion + part
            continue
        out, y = out.double().cpu().reshape(len(y), -1), y.double().reshape(len(y), -1)
        err = out - y
        part = torch.stack([err.pow(2).sum(0), err.abs().sum(0), y.sum(0), y.pow(2).sum(0)])
        n = len(y) if sums is None else sums[1] + len(y)
        sums = (part, n) if sums is None else (sums[0] + part, n)
    if task == "classification":
        return {"confusion": confusion.tolist()} if confusion is not None else {}
    return _regression_figures(*sums) if sums is not None else {}


def _regression_figures(s: torch.Tensor, n: int) -> dict:
    sse, sae, sy, syy = s
    k = len(sse)
    sst = syy - sy.pow(2) / n
    r2 = torch.where(sst > 0, 1 - sse / sst.clamp_min(1e-300), torch.where(sse == 0, 1.0, 0.0))
    return {"val_mse": float(sse.sum() / (n * k)), "val_mae": float(sae.sum() / (n * k)), "val_r2": float(r2.mean())}


def class_names(confusion: list[list[int]], *candidates) -> list:
    """The first list of names among ``candidates`` (a model dir's labels, the data's classes), indices for the
    classes beyond it: one name a row of ``confusion``."""
    names = next((c for c in candidates if isinstance(c, list) and c), [])[:len(confusion)]
    return [*names, *range(len(names), len(confusion))]


def per_class(confusion: list[list[int]], names: list) -> list[dict]:
    """Precision, recall, F1 and support of each class (0 where a denominator is 0)."""
    m = torch.tensor(confusion, dtype=torch.float64)
    tp, predicted, actual = m.diagonal(), m.sum(0), m.sum(1)
    precision = torch.where(predicted > 0, tp / predicted.clamp_min(1), 0.0)
    recall = torch.where(actual > 0, tp / actual.clamp_min(1), 0.0)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp_min(1e-300), 0.0)
    return [{"class": names[i], "precision": float(precision[i]), "recall": float(recall[i]), "f1": float(f1[i]),
             "support": int(actual[i])} for i in range(len(names))]


def plot_inches(classes: int) -> float:
    """The side of the confusion matrix's square figure in inches (times ``DPI``: its pixels)."""
    return min(20.0, max(5.0, 1.5 + 0.45 * classes))


def confusion_png(confusion: list[list[int]], names: list, path: str | Path, title: str) -> Path | None:
    """The confusion matrix drawn as a PNG at ``path`` (square, ``plot_inches`` × ``DPI`` pixels a side), written
    atomically; None (nothing written) above ``MAX_PLOT_CLASSES`` classes."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    from prunus.artifacts.atomic import atomic_write_bytes

    c = len(confusion)
    if c > MAX_PLOT_CLASSES:
        return None
    side = plot_inches(c)
    fig = Figure(figsize=(side, side), dpi=DPI)
    ax = fig.add_subplot()
    m = torch.tensor(confusion)
    ax.imshow(m.numpy(), cmap="Blues")
    labels = [str(n)[:16] for n in names]
    ax.set_xticks(range(c), labels, rotation=90 if c > 6 else 0)
    ax.set_yticks(range(c), labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title[:80], fontsize=10)
    if c <= 30:
        top = int(m.max()) or 1
        for i in range(c):
            for j in range(c):
                ax.text(j, i, str(int(m[i, j])), ha="center", va="center", fontsize=8,
                        color="white" if m[i, j] > top / 2 else "black")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    atomic_write_bytes(path, buf.getvalue())
    return Path(path)
