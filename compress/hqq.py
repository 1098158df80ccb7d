"""HQQ (Badri & Shaji, 2023): calibration-free int4 scales and zero points by half-quadratic optimisation.

Round-to-nearest sets each group's scale and zero point from its min and max, which one
outlier stretches. HQQ instead minimises an lp-norm (p < 1, robust to outliers) of the
weight error, splitting it with an auxiliary error variable E (half-quadratic splitting)::

    q  = clamp(round(W / s + z))                      # the grid as it stands
    E  = shrink_p(W - (q - z) s, beta)                # generalized soft-thresholding
    z  = mean(q - (W - E) / s)                        # closed form for the zero point
    s  = <W - E, q - z> / <q - z, q - z>              # closed form for the scale
    beta *= kappa

prunus stores integer zero points (ONNX Runtime's ``MatMulNBits`` and tinygemm take them),
so after the iterations z is rounded and q recomputed. Then, per group, the parameters
with the smaller squared error (HQQ's or round-to-nearest's) are kept, so HQQ's weight
error never exceeds RTN's. Symmetric: z stays 8 and only the scale moves.

Beside torchao's and the original HQQ (``optimize_weights_proximal``: p 0.7, beta 10, kappa 1.01, 20
iterations with an early stop, groups along the input features), two differences: they move only the
zero point and keep it in float, prunus also fits the scale and stores an integer zero point. The float
zero point is what makes theirs better on SmolLM2-135M at group 64 (torchao +9.0% bits per byte, prunus
+11.9%, RTN +12.3%): with its zero point rounded to an integer at the end torchao's scores +12.3%, the
same as RTN. That model was dequantized from a Q4_1 GGUF, whose groups of 32 are exact grids
d * k + m with a float minimum m, which a float zero point partly reproduces (torchao's squared weight
error is 0.63x RTN's there, prunus's 0.94x); on weights trained in float the two are close (0.91x and
0.94x on the demo model). prunus keeps integer zero points because ONNX Runtime's ``MatMulNBits`` (and
its own HQQ output) with float zero points leaves the fast CPU kernel: a 576 x 4,608 layer took about 40x
the time of integer zero points at accuracy level 4.
"""

from __future__ import annotations

import torch

from prunus.models.int4 import QMAX, SYMMETRIC_ZERO, rtn_params

_EPS = 1e-12


def _shrink(x: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    """The proximal operator of |x|^p / beta (generalized soft-thresholding, as in HQQ)."""
    return torch.sign(x) * torch.relu(x.abs() - (1.0 / beta) * x.abs().clamp(min=1e-8).pow(p - 1))


@torch.no_grad()
def hqq_int4(w: torch.Tensor, group_size: int, symmetric: bool, *, iters: int = 20, p: float = 0.7,
             beta: float = 10.0, kappa: float = 1.01) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unpacked values (out, in) uint8, scale, zero point (out, n_groups) uint8) for weight ``w``."""
    out_f, in_f = w.shape
    W = w.detach().float().reshape(-1, group_size)  # one group per row
    s0, z0 = rtn_params(w, group_size, symmetric)
    s, z = s0.reshape(-1, 1).clone(), z0.reshape(-1, 1).float()
    for _ in range(iters):
        q = (W / s + z).round().clamp(0, QMAX)
        E = _shrink(W - (q - z) * s, beta, p)
        target = W - E
        if not symmetric:
            z = (q - target / s).mean(dim=1, keepdim=True).clamp(0, QMAX)
        qz = q - z
        denom = (qz * qz).sum(dim=1, keepdim=True)
        s = torch.where(denom > 0, (target * qz).sum(dim=1, keepdim=True) / denom.clamp(min=_EPS), s)
        s = torch.where(s.abs() < _EPS, torch.where(s < 0, -_EPS, _EPS), s)  # symmetric scales may be negative
        beta *= kappa
    z = z.round().clamp(0, QMAX) if not symmetric else torch.full_like(z, SYMMETRIC_ZERO)
    q = (W / s + z).round().clamp(0, QMAX)
    err = ((q - z) * s - W).pow(2).sum(dim=1, keepdim=True)
    s0, z0 = s0.reshape(-1, 1), z0.reshape(-1, 1).float()
    q0 = (W / s0 + z0).round().clamp(0, QMAX)
    err0 = ((q0 - z0) * s0 - W).pow(2).sum(dim=1, keepdim=True)
    better = err < err0
    q, s, z = torch.where(better, q, q0), torch.where(better, s, s0), torch.where(better, z, z0)
    n_groups = in_f // group_size
    return (q.reshape(out_f, in_f).to(torch.uint8), s.reshape(out_f, n_groups),
            z.reshape(out_f, n_groups).to(torch.uint8))


__all__ = ["hqq_int4"]
