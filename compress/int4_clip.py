"""Clipped int4 grids: each group's range shrunk to the factor whose rounding error is smallest.

Round to nearest spans each group's whole range, so one outlier stretches the step for the
other 63 values. The grid search GPTQ's reference quantizer (``mse=True``) and llm-compressor's
MSE observer run instead tries the range scaled by p = 1, 0.99, ..., ``1 - MAX_SHRINK`` and keeps,
per group, the p minimising sum_j imp_j |w_j - dq_j|^NORM (the outlier is clipped, the rest
rounded more finely). ``imp`` weights the input columns: GPTQ passes its Hessian's diagonal
(the energy of each input, so the search minimises an estimate of the output error instead of
the weight error); None weighs them equally.

Scaling a range by p is the same as fitting the grid of :func:`prunus.models.int4.rtn_params` to
p * w: the step scales by p, the zero point stays (symmetric, integer and float zero points alike).
"""

from __future__ import annotations

import torch

from prunus.models.int4 import QMAX, round_half_up, rtn_params

from .options import INT4_CLIPS as CLIPS

MAX_SHRINK = 0.25  # p from 1 down to 0.75
STEPS = 25
NORM = 2.4  # GPTQ's reference norm: between squared error and a maximum


def shrink_factors() -> list[float]:
    return [1 - MAX_SHRINK * i / STEPS for i in range(STEPS + 1)]


@torch.no_grad()
def clip_params(w: torch.Tensor, group_size: int, symmetric: bool, float_zero: bool = False,
                imp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero point), each (out, n_groups), of the shrunk range with the least weighted rounding error
    (same dtypes as :func:`rtn_params`)."""
    w = w.detach().float()
    out_f, in_f = w.shape
    groups = w.reshape(out_f, in_f // group_size, group_size)
    weight = None if imp is None else imp.detach().float().clamp(min=0).reshape(1, in_f // group_size, group_size)
    best = None
    for p in shrink_factors():
        scale, zero = rtn_params(w * p, group_size, symmetric, float_zero)
        s, z = scale.unsqueeze(2), zero.float().unsqueeze(2)
        dq = (round_half_up(groups * (1 / s) + z).clamp(0, QMAX) - z) * s
        err = (dq - groups).abs().pow(NORM)
        err = (err if weight is None else err * weight).sum(2)
        if best is None:
            best = [err, scale, zero]
            continue
        better = err < best[0]
        best = [torch.where(better, err, best[0]), torch.where(better, scale, best[1]),
                torch.where(better, zero, best[2])]
    return best[1], best[2]


def grid_params(w: torch.Tensor, group_size: int, symmetric: bool, float_zero: bool = False, clip: str = "none",
                imp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid of ``w`` by ``clip``: each group's own range ("none") or the searched one ("mse")."""
    if clip == "mse":
        return clip_params(w, group_size, symmetric, float_zero, imp)
    return rtn_params(w, group_size, symmetric, float_zero)


__all__ = ["CLIPS", "clip_params", "grid_params", "shrink_factors"]
