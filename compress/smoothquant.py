"""SmoothQuant: move activation outliers into the weights before W8A8 quantization.

For a Linear fed by an RMSNorm, y = W (g * x_hat) = (W diag(s)) ((g / s) * x_hat) for
any positive per-channel s. With a_j the largest |input| of channel j on calibration
data and w_j the largest |weight| of column j (over every Linear reading that norm),
s_j = a_j^alpha / w_j^(1 - alpha) evens out the two ranges (Xiao et al., 2023). The
scales are folded into the norm's weight and the Linear weights, so the model stays a
float model computing the same function (up to float rounding); quantize after it.

Folded per block: attention_norm -> wq, wk, wv and ffn_norm -> w1, w3 (mixture-of-experts
feed-forwards are left as they are).
"""

from __future__ import annotations

import torch
from torch import nn

from prunus.artifacts.errors import PrunusError

from prunus.models.llama import OffsetRMSNorm
from prunus.models.quant_registry import is_quantized

from .calibrate import channel_absmax

# (norm, the Linear modules reading it), relative to a block
FOLDS = (("attention_norm", ("attention.wq", "attention.wk", "attention.wv")),
         ("ffn_norm", ("feed_forward.w1", "feed_forward.w3")))


def _find(block: nn.Module, name: str):
    try:
        return block.get_submodule(name)
    except AttributeError:
        return None


def smoothing_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    w_absmax = torch.cat([w.detach().float().abs() for w in weights], dim=0).amax(dim=0)
    s = act_absmax.clamp(min=1e-5).pow(alpha) / w_absmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


def smoothquant_pass(model, ctx, *, alpha: float = 0.5, n_calib: int = 8):
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise PrunusError(f"smoothquant: alpha={alpha!r} must be a number in [0, 1] (0.5 is usual)")
    targets = []
    for key, block in model.layers.items():
        for norm_name, linear_names in FOLDS:
            linears = [_find(block, n) for n in linear_names]
            if any(is_quantized(m) for m in linears):
                raise PrunusError("smoothquant: the model is already quantized; put smoothquant before quantize in the recipe")
            if any(type(m) is not nn.Linear for m in linears):
                continue  # e.g. a mixture-of-experts block: its experts are not plain Linear modules
            targets.append((block.get_submodule(norm_name), [f"layers.{key}.{n}" for n in linear_names], linears))
    stats = channel_absmax(model, [names[0] for _, names, _ in targets], ctx.calibration(n_calib))
    with torch.no_grad():
        for norm, names, linears in targets:
            s = smoothing_scales(stats[names[0]], [m.weight for m in linears], float(alpha))
            if isinstance(norm, OffsetRMSNorm):  # Gemma's norm scales by (1 + weight)
                norm.weight.copy_((1 + norm.weight.float()) / s - 1)
            else:
                norm.weight.div_(s.to(norm.weight.dtype))
            for m in linears:
                m.weight.mul_(s.to(m.weight.dtype))
    return model
