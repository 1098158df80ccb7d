"""GPTQ (Frantar et al., 2022): int4 weights chosen column by column to cancel the output error.

For a Linear with inputs X, the layer's output error ||X W^T - X Q^T||^2 is a quadratic
form in the weight error with Hessian H = 2 X^T X. GPTQ quantizes one input column at a
time and moves that column's rounding error onto the columns not yet quantized, using the
upper Cholesky factor of H^-1 (optimal brain surgeon updates). Here:

* ``damp``: a fraction of the mean diagonal of H added to the diagonal (H is often
  singular: dead channels, few tokens);
* lazy batch updates: columns are processed in blocks of ``block_size``; the rest of the
  matrix is updated once per block (one matmul) instead of once per column;
* ``act_order``: columns in decreasing order of H's diagonal (the inputs with the most
  energy first). Groups then use "static" scales computed from the float weight before
  any update, so each group still covers consecutive input features and the storage
  format is unchanged. Without act_order each group's scale and zero point are computed
  when GPTQ reaches the group, from the already-updated weights (as the paper does);
* ``clip``: "mse" fits each group's range by the search of :mod:`.int4_clip`, weighing each
  column's error by H's diagonal (its input's energy), instead of spanning the whole range
  (weighing the columns equally helps less; docs/results.md, int4 on SmolLM2).

The Hessians come from calibration activations of the float model, in one pass with hooks
(:func:`hessians`). On SmolLM2-135M this scored better than collecting them block by block
through the already-quantized blocks, and far better than leaving out each row's first position
(where the model's massive activations are): those tokens' activations must be reproduced, not
ignored.
"""

from __future__ import annotations

import torch
from torch import nn

from prunus.models.int4 import QMAX, round_half_up

from .calibrate import observe_inputs
from .int4_clip import grid_params


# Linear modules of a block that read the same tensor: one Hessian serves them all
SHARED_INPUTS = (("attention.wq", "attention.wk", "attention.wv"), ("feed_forward.w1", "feed_forward.w3"))


def input_groups(names: list[str]) -> dict[str, str]:
    """name -> the name whose inputs stand for it (the first of its SHARED_INPUTS set present in ``names``)."""
    present, rep = set(names), {}
    for name in names:
        rep[name] = name
        for group in SHARED_INPUTS:
            for member in group:
                if name.endswith("." + member):
                    prefix = name[: -len(member)]
                    rep[name] = next(prefix + m for m in group if prefix + m in present)
    return rep


@torch.no_grad()
def hessians(model: nn.Module, names: list[str], batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """name -> H = 2 X^T X / n (float32, (in, in)) of the module's inputs over ``batches``.
    Modules reading the same tensor (wq, wk, wv) share one matrix."""
    rep = input_groups(names)

    def reduce(x, prev):  # (sum of x^T x, token count)
        total, count = prev if prev is not None else (0, 0)
        return x.t() @ x + total, count + x.shape[0]

    stats = observe_inputs(model, sorted(set(rep.values())), batches, reduce)  # calibrate.py
    shared = {r: 2 * s / n for r, (s, n) in stats.items()}
    return {n: shared[r] for n, r in rep.items()}


def _quantize_column(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = round_half_up(w * (1 / scale) + zero).clamp(0, QMAX)
    return q, (q - zero) * scale


@torch.no_grad()
def gptq_int4(w: torch.Tensor, H: torch.Tensor, group_size: int, symmetric: bool, *, damp: float = 0.01,
              block_size: int = 128, act_order: bool = False,
              float_zero: bool = False, clip: str = "none") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unpacked values (out, in) uint8, scale, zero point (out, n_groups): uint8, float32 with ``float_zero``)
    for weight ``w`` and Hessian ``H``; ``clip`` "mse" searches each group's range weighted by H's diagonal."""
    W = w.detach().float().clone()
    out_f, n = W.shape
    H = H.detach().float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    n_groups = n // group_size
    scale = torch.empty(out_f, n_groups)
    zero = torch.empty(out_f, n_groups)
    perm = torch.arange(n)
    energy = torch.diag(H).clone() if clip == "mse" else None  # before the damping
    if act_order:
        scale, zero = (t.float() for t in grid_params(W, group_size, symmetric, float_zero, clip, energy))  # static
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(n)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros(out_f, n)
    block_size = max(group_size, block_size - block_size % group_size)  # groups never straddle blocks
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            g = col // group_size
            if not act_order and col % group_size == 0:
                imp = None if energy is None else energy[col:col + group_size]
                s, z = grid_params(W1[:, i:i + group_size], group_size, symmetric, float_zero, clip, imp)
                scale[:, g], zero[:, g] = s[:, 0], z[:, 0].float()
            q, dq = _quantize_column(W1[:, i], scale[:, g], zero[:, g])
            Q[:, i1 + i] = q
            err = (W1[:, i] - dq) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    if act_order:
        Q = Q[:, torch.argsort(perm)]
    return Q.to(torch.uint8), scale, zero if float_zero else round_half_up(zero).to(torch.uint8)


__all__ = ["SHARED_INPUTS", "input_groups", "hessians", "gptq_int4"]
