"""Activation statistics from calibration batches: what static quantization and SmoothQuant measure.

Forward hooks record the inputs of chosen Linear modules while the model runs on
calibration tokens; nothing in the model changes.

* ``input_absmax``: one number per module, the range a per-tensor activation scale
  must cover: ``minmax`` (the largest |x| seen) or ``percentile`` (the mean over
  batches of each batch's p-th percentile of |x|, which ignores rare outliers).
* ``channel_absmax``: the largest |x| per input channel (SmoothQuant's statistic).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from prunus.artifacts.errors import PrunusError

from .options import CALIBRATION_METHODS, check_calibration

METHODS = CALIBRATION_METHODS  # prunus.compress.options


@torch.no_grad()
def observe_inputs(model: nn.Module, names: Iterable[str], batches: list[torch.Tensor],
                   reduce: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run ``batches`` through ``model``; for each named module fold its inputs (n, in) into a statistic with
    ``reduce(x, previous)`` (previous is None on the first call)."""
    stats: dict[str, torch.Tensor | None] = {}
    hooks = []
    device = next(model.parameters()).device
    for name in names:
        stats[name] = None

        def hook(module, args, name=name):
            x = args[0].detach().float()
            stats[name] = reduce(x.reshape(-1, x.shape[-1]), stats[name])

        hooks.append(model.get_submodule(name).register_forward_pre_hook(hook))
    try:
        for tokens in batches:
            model(tokens.to(device))
    finally:
        for h in hooks:
            h.remove()
    return stats


def channel_absmax(model: nn.Module, names: Iterable[str], batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """name -> largest |x| per input channel, shape (in,)."""
    def reduce(x, prev):
        m = x.abs().amax(dim=0)
        return m if prev is None else torch.maximum(prev, m)

    return observe_inputs(model, names, batches, reduce)


def input_absmax(model: nn.Module, names: Iterable[str], batches: list[torch.Tensor], *, method: str = "minmax",
                 percentile: float = 99.99) -> dict[str, float]:
    """name -> the |x| a per-tensor activation scale should map to the largest quantized value."""
    check_calibration(method, percentile)
    if not batches:
        raise PrunusError("quantize: static calibration needs at least one batch; set n_calib >= 1")
    if method == "minmax":
        def reduce(x, prev):
            m = x.abs().amax()
            return m if prev is None else torch.maximum(prev, m)
    else:
        def reduce(x, prev):  # running (sum of per-batch percentiles, count)
            a = x.abs().flatten()
            k = max(1, min(a.numel(), int(round(a.numel() * percentile / 100))))
            p = a.kthvalue(k).values
            entry = torch.stack([p, torch.ones(())])
            return entry if prev is None else prev + entry

    stats = observe_inputs(model, names, batches, reduce)
    if method == "percentile":
        return {n: float(s[0] / s[1]) for n, s in stats.items()}
    return {n: float(s) for n, s in stats.items()}
