"""HQQ (Badri & Shaji, 2023): calibration-free int4 scales and zero points by half-quadratic optimisation.

Round-to-nearest sets each group's scale and zero point from its min and max, which one
outlier stretches. HQQ instead minimises an lp-norm (p < 1, robust to outliers) of the
weight error, splitting it with an auxiliary error variable E (half-quadratic splitting)::

    q  = clamp(round(W / s + z))                      # the grid as it stands
    E  = shrink_p(W - (q - z) s, beta)                # generalized soft-thresholding
    z  = mean(q - (W - E) / s)                        # closed form for the zero point
    s  = <W - E, q - z> / <q - z, q - z>              # closed form for the scale
    beta *= kappa

Two modes:

* ``float_zero`` (asymmetric): the reference HQQ, as torchao and the original ``optimize_weights_proximal``
  run it (p 0.7, beta 10, kappa 1.01, up to 20 iterations, stopping once the mean absolute error stops
  falling): the step is round-to-nearest's min-max step, the zero point starts rounded and alone is
  fitted, and stays a float (exported as an integer zero point plus a per-group term,
  :mod:`prunus.export.int4_float_zero`). On SmolLM2-135M it scores as torchao's HQQ does on the same
  weights, well below round to nearest (docs/results.md, int4 on SmolLM2); starting from the unrounded
  zero point, fitting the scale too, or keeping per group the squared-error-better of HQQ's and
  round-to-nearest's grids each scored worse: HQQ's lp objective spares the outliers that squared error
  weighs most, so that fallback is for the integer mode only. At group 32 the model's own Q4_1 grids (it
  was dequantized from one) come back exactly.
* integer zero points (the default; ``MatMulNBits`` and tinygemm take them at full speed): scale and
  zero point are both fitted, z is rounded at the end and q recomputed; then, per group, the parameters
  with the smaller squared error (HQQ's or round-to-nearest's) are kept, so the weight error never
  exceeds RTN's (docs/results.md has both on SmolLM2). Symmetric: z stays 8 and only the scale moves.
"""

from __future__ import annotations

import torch

from prunus.models.int4 import QMAX, SYMMETRIC_ZERO, round_half_up, rtn_params

_EPS = 1e-12


def _shrink(x: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    """The proximal operator of |x|^p / beta (generalized soft-thresholding, as in HQQ)."""
    return torch.sign(x) * torch.relu(x.abs() - (1.0 / beta) * x.abs().clamp(min=1e-8).pow(p - 1))


def _fit(W: torch.Tensor, s: torch.Tensor, z: torch.Tensor, *, fit_zero: bool, fit_scale: bool, float_zero: bool,
         iters: int, p: float, beta: float, kappa: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The half-quadratic iterations on groups ``W`` (one per row) from (s, z); returns the fitted (s, z).
    A zero-point-only fit stops once the mean absolute weight error stops falling, as the reference does."""
    best = float("inf")
    for _ in range(iters):
        q = (W / s + z).round().clamp(0, QMAX)
        error = W - (q - z) * s
        target = W - _shrink(error, beta, p)
        if fit_zero:
            z = (q - target / s).mean(dim=1, keepdim=True)
            z = z if float_zero else z.clamp(0, QMAX)
        if fit_scale:
            qz = q - z
            denom = (qz * qz).sum(dim=1, keepdim=True)
            s = torch.where(denom > 0, (target * qz).sum(dim=1, keepdim=True) / denom.clamp(min=_EPS), s)
            s = torch.where(s.abs() < _EPS, torch.where(s < 0, -_EPS, _EPS), s)  # symmetric scales may be negative
        beta *= kappa
        mean_error = float(error.abs().mean())
        if mean_error >= best and not fit_scale:
            break
        best = min(best, mean_error)
    return s, z


@torch.no_grad()
def hqq_int4(w: torch.Tensor, group_size: int, symmetric: bool, *, float_zero: bool = False, iters: int = 20,
             p: float = 0.7, beta: float = 10.0, kappa: float = 1.01) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unpacked values (out, in) uint8, scale, zero point (out, n_groups): uint8, float32 with ``float_zero``)
    for weight ``w``."""
    out_f, in_f = w.shape
    W = w.detach().float().reshape(-1, group_size)  # one group per row
    s0, z0 = rtn_params(w, group_size, symmetric, float_zero)
    s0, z0 = s0.reshape(-1, 1), z0.reshape(-1, 1).float()
    n_groups = in_f // group_size
    if float_zero:  # the reference HQQ: the min-max step, the zero point rounded, then the zero point alone fitted
        s, z = _fit(W, s0, z0.round(), fit_zero=True, fit_scale=False, float_zero=True, iters=iters, p=p, beta=beta,
                    kappa=kappa)
        q = (W / s + z).round().clamp(0, QMAX)
        return q.reshape(out_f, in_f).to(torch.uint8), s.reshape(out_f, n_groups), z.reshape(out_f, n_groups)
    s, z = _fit(W, s0.clone(), z0, fit_zero=not symmetric, fit_scale=True, float_zero=False, iters=iters, p=p,
                beta=beta, kappa=kappa)
    z = torch.full_like(z, SYMMETRIC_ZERO) if symmetric else z.round().clamp(0, QMAX)
    q = (W / s + z).round().clamp(0, QMAX)
    err = ((q - z) * s - W).pow(2).sum(dim=1, keepdim=True)
    q0 = round_half_up(W * (1 / s0) + z0).clamp(0, QMAX)  # round to nearest's own integers
    err0 = ((q0 - z0) * s0 - W).pow(2).sum(dim=1, keepdim=True)
    better = err < err0  # per group, the better (squared error) of HQQ's and round-to-nearest's grid
    q, s, z = torch.where(better, q, q0), torch.where(better, s, s0), torch.where(better, z, z0)
    return q.reshape(out_f, in_f).to(torch.uint8), s.reshape(out_f, n_groups), z.reshape(out_f, n_groups).to(torch.uint8)


__all__ = ["hqq_int4"]
