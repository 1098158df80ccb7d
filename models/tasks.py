"""Tasks: what a generic module is trained on and judged by (the loss and the quality metric).

| task | loss (a mean over the batch) | held-out figures |
|---|---|---|
| ``classification`` | cross-entropy of (N, C) logits against (N,) class indices | ``val_loss``, ``val_accuracy`` (top-1) |
| ``regression`` | mean squared error against a target of the output's shape | ``val_loss`` (the MSE) |
| ``causal-lm`` | token cross-entropy of (N, T, V) logits against (N, T) ids (``-100`` left out) | ``val_loss``, ``val_accuracy`` (top-1 tokens) |
| ``package.module:fn`` | ``fn(output, target)``, the user's scalar loss | ``val_loss`` |

A user loss is a factory spec (:mod:`.module_factory`) and follows its trust rule when read back from an
artifact: it is imported only when the caller trusts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short

from .module_factory import check_trusted, parse_spec, resolve_callable

TASKS = ("classification", "regression", "causal-lm")
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Task:
    """``loss(output, target)`` -> a scalar (the batch mean); ``sums(output, target)`` -> (summed loss, count,
    correct top-1 or None) of one held-out batch; ``name`` is what config.json records."""

    name: str
    loss: Callable
    sums: Callable
    metric: str | None  # "accuracy" where top-1 is judged

    def summary(self, loss_sum: float, count: int, correct: int | None) -> dict:
        """The held-out figures from the sums over every batch."""
        out = {"val_loss": loss_sum / max(count, 1), "val_samples": count}
        if self.metric == "accuracy" and correct is not None:
            out["val_accuracy"] = correct / max(count, 1)
        return out


def _check_logits(output, target, name: str):
    if output.ndim != target.ndim + 1:
        raise PrunusError(f"task {name}: the model returns shape {tuple(output.shape)} for targets of shape "
                          f"{tuple(target.shape)}; {name} needs one more (class) dimension in the output")


def _classification():
    import torch.nn.functional as F

    def loss(out, y):
        _check_logits(out, y, "classification")
        return F.cross_entropy(out.float(), y.long())

    def sums(out, y):
        _check_logits(out, y, "classification")
        return (float(F.cross_entropy(out.float(), y.long(), reduction="sum")), y.numel(),
                int((out.argmax(-1) == y).sum()))

    return Task("classification", loss, sums, "accuracy")


def _regression():
    import torch.nn.functional as F

    def _fit(out, y):
        if out.shape != y.shape and out.numel() == y.numel():
            return y.reshape(out.shape)
        if out.shape != y.shape:
            raise PrunusError(f"task regression: the model returns shape {tuple(out.shape)} for targets of shape "
                              f"{tuple(y.shape)}; return one value per target")
        return y

    def loss(out, y):
        return F.mse_loss(out.float(), _fit(out, y).float())

    def sums(out, y):
        return float(F.mse_loss(out.float(), _fit(out, y).float(), reduction="sum")), y.numel(), None

    return Task("regression", loss, sums, None)


def _causal_lm():
    import torch.nn.functional as F

    def loss(out, y):
        _check_logits(out, y, "causal-lm")
        return F.cross_entropy(out.float().flatten(0, -2), y.long().flatten(), ignore_index=IGNORE_INDEX)

    def sums(out, y):
        _check_logits(out, y, "causal-lm")
        kept = y != IGNORE_INDEX
        nll = F.cross_entropy(out.float().flatten(0, -2), y.long().flatten(), ignore_index=IGNORE_INDEX,
                              reduction="sum")
        return float(nll), int(kept.sum()), int(((out.argmax(-1) == y) & kept).sum())

    return Task("causal-lm", loss, sums, "accuracy")


def _user_loss(spec: str):
    fn = resolve_callable(spec, "--task")

    def loss(out, y):
        value = fn(out, y)
        if not hasattr(value, "ndim") or value.ndim != 0:
            raise PrunusError(f"--task {spec}: the loss returned {short(type(value).__name__)} of shape "
                              f"{tuple(getattr(value, 'shape', ()))}; return a scalar tensor (the batch mean)")
        return value

    def sums(out, y):
        return float(loss(out, y)) * len(y), len(y), None

    return Task(spec, loss, sums, None)


_BUILT_IN = {"classification": _classification, "regression": _regression, "causal-lm": _causal_lm}


def check_task_name(name, source: str = "--task") -> str:
    """``name`` when it is a built-in task or a loss spec (not imported), else one line."""
    if name in _BUILT_IN:
        return name
    if isinstance(name, str) and ":" in name:
        parse_spec(name, source)
        return name
    raise PrunusError(f"{source} {short(name)}: choose {', '.join(TASKS)}, or a loss package.module:fn")


def get_task(name: str, *, trust=True, where: str | None = None) -> Task:
    """The task ``name`` (a built-in, or a user loss spec imported when trusted; ``where``: the artifact it
    was read from, for the trust line). The user's own ``--task`` is trusted (the default)."""
    name = check_task_name(name, "--task" if where is None else f"{where}: task")
    if name in _BUILT_IN:
        return _BUILT_IN[name]()
    if where is not None:
        check_trusted(name, trust, where)
    return _user_loss(name)
