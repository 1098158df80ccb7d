"""Whether a generic module fits its data, checked before training starts: the module runs on the data's first
sample (its channels and size) and its task's loss takes the output and the target; a classifier scores at
least as many classes as the data holds. A misfit is one line naming the data and what to change.

The trial forward runs in eval mode without gradients (BatchNorm's running statistics are left as they are),
and every submodule's train / eval mode is put back after it.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils.data import default_collate

from prunus.artifacts.errors import PrunusError

from .prefetch import to_device

MISFITS = (RuntimeError, IndexError, ValueError, TypeError)  # what torch raises for a wrong shape, dtype or class
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def data_classes(dataset) -> int | None:
    """The classes a dataset holds: its ``num_classes``, else the length of its ``classes`` (torchvision's)."""
    n = getattr(dataset, "num_classes", None)
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    names = getattr(dataset, "classes", None)
    return len(names) if isinstance(names, (list, tuple)) and names else None


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"samples of shape {tuple(x.shape[1:])}"
    return "its samples"


def _channel_hint(module: nn.Module, x) -> str | None:
    """What to change when the module's first convolution takes another number of channels than the data has."""
    if not isinstance(x, torch.Tensor):
        return None
    for name, layer in module.named_modules():
        if isinstance(layer, CONVS):
            spatial = next(i + 1 for i, kind in enumerate(CONVS) if isinstance(layer, kind))
            have = x.shape[1] if x.ndim == spatial + 2 else None
            if have is not None and 0 < layer.in_channels != have:
                want = layer.in_channels
                return (f"its first convolution ({name or 'the module'}) takes {want} channel{'s' if want > 1 else ''} "
                        f"and the images have {have}; build it with {have} input channels (e.g. --model-args "
                        f"channels={have}) or give {want}-channel images")
            return None
    return None


def _check_classes(output, dataset, source: str) -> None:
    have = data_classes(dataset)
    if not isinstance(output, torch.Tensor) or output.ndim < 2 or have is None:
        return
    scores = output.shape[1]
    if have != scores and getattr(dataset, "exact_classes", False):  # a table: its classes are all there are
        raise PrunusError(f"{source}: {have} classes in the target, but the module scores {scores}; build it with "
                          f"{have} outputs (e.g. --model-args num_classes={have}, as its factory names it)")
    if have > scores:
        raise PrunusError(f"{source}: {have} classes, but the module scores {scores}; build it with {have} outputs "
                          f"(e.g. --model-args num_classes={have}, as its factory names it) or give data of at most "
                          f"{scores} classes")


def check_fits(module: nn.Module, dataset, task, call: Callable, source: str = "--data") -> None:
    """One line unless ``module`` (run as ``call(module, input)``) takes the first sample of ``dataset`` and
    ``task``'s loss takes its output and target, with at least the data's classes for a classifier."""
    x, y = default_collate([dataset[0]])
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    x, y = to_device(x, device), to_device(y, device)
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        with torch.no_grad():
            output = call(module, x)
            if task.name == "classification":
                _check_classes(output, dataset, source)
            task.loss(output, y)
    except PrunusError:
        raise
    except torch.cuda.OutOfMemoryError:
        raise
    except MISFITS as e:
        first = (str(e).strip().splitlines() or [""])[0]
        first = first if len(first) <= 160 else first[:157] + "..."
        hint = _channel_hint(module, x)
        if hint:
            raise PrunusError(f"{source}: {_describe(x)} do not fit the module: {hint}") from None
        raise PrunusError(f"{source}: {_describe(x)} do not fit the module ({type(e).__name__}: {first}); make the "
                          "data and the module agree (channels, size, classes)") from None
    finally:
        for m, training in modes.items():
            m.training = training
