"""AWQ (Lin et al., 2023): per-input-channel scales that protect the weights salient activations read.

For a Linear reading x, y = W x = (W diag(s)) (x / s). Scaling a weight column up by s_j
before rounding shrinks its relative rounding error; the activation is scaled down by the
same s_j, so a channel with large activations (the salient one) loses less. AWQ searches
s = mean|x|^alpha over a grid of alpha in [0, 1] (alpha 0 is plain round-to-nearest) and
keeps, per set of Linear modules reading one tensor, the alpha whose int4 output error
||(x / s) Q(W s)^T - x W^T||^2 on calibration activations is smallest.

The scales are folded exactly as :mod:`prunus.compress.smoothquant` folds its own: into
the RMSNorm feeding wq / wk / wv and w1 / w3 (its weight divided by s, the Linears' columns
multiplied), and for w2 into the rows of w3 (w2 reads silu(w1 x) * (w3 x), linear in w3's
output). The model stays a float model computing the same function up to float rounding;
the int4 rounding comes after (:mod:`prunus.compress.int4`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from prunus.models.llama import OffsetRMSNorm

from .calibrate import observe_inputs
from .smoothquant import FOLDS

MAX_ROWS = 512  # calibration tokens kept per input for the search
GRID = 11  # alpha in 0, 0.1, ..., 1


def fold_targets(model: nn.Module) -> list[tuple[str, nn.Module, list[str]]]:
    """(kind, the module whose output gets 1/s, names of the Linear modules whose columns get s) per fold:
    kind "norm" (attention_norm / ffn_norm) or "linear" (w3 -> w2); plain nn.Linear modules only."""
    out = []
    for key, block in model.layers.items():
        for norm_name, linear_names in FOLDS:
            try:
                linears = [block.get_submodule(n) for n in linear_names]
            except AttributeError:
                continue
            if all(type(m) is nn.Linear for m in linears):
                out.append(("norm", block.get_submodule(norm_name), [f"layers.{key}.{n}" for n in linear_names]))
        try:
            w3, w2 = block.get_submodule("feed_forward.w3"), block.get_submodule("feed_forward.w2")
        except AttributeError:
            continue
        if type(w3) is nn.Linear and type(w2) is nn.Linear:
            out.append(("linear", w3, [f"layers.{key}.feed_forward.w2"]))
    return out


@torch.no_grad()
def input_samples(model: nn.Module, names: list[str], batches: list[torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (mean |x| per input channel over every calibration token, up to MAX_ROWS token rows of x)."""
    per_batch = max(1, MAX_ROWS // max(1, len(batches)))

    def reduce(x, prev):  # (sum of |x| per channel, token count, sampled rows)
        total, count, rows = prev if prev is not None else (0, 0, [])
        rows.append(x[::max(1, x.shape[0] // per_batch)][:per_batch].clone())
        return x.abs().sum(0) + total, count + x.shape[0], rows

    stats = observe_inputs(model, names, batches, reduce)  # calibrate.py: forward pre-hooks on the inputs
    return {n: (stats[n][0] / stats[n][1], torch.cat(stats[n][2])) for n in names}


def search_scale(x_mean: torch.Tensor, x: torch.Tensor, weights: list[torch.Tensor],
                 fake_quant: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, float]:
    """(per-channel scale s, its alpha) minimising the summed int4 output error of ``weights`` on rows ``x``."""
    refs = [x @ w.float().t() for w in weights]
    best = (None, None, float("inf"))
    for alpha in torch.linspace(0, 1, GRID).tolist():
        s = x_mean.clamp(min=1e-4).pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        xs = x / s
        err = sum(float((xs @ fake_quant(w.float() * s).t() - r).pow(2).sum()) for w, r in zip(weights, refs))
        if err < best[2]:
            best = (s, alpha, err)
    return best[0], best[1]


@torch.no_grad()
def fold(kind: str, source: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """Divide ``source``'s output by s and multiply the Linears' input columns by s (exact in real numbers)."""
    if kind == "norm":
        if isinstance(source, OffsetRMSNorm):  # Gemma's norm scales by (1 + weight)
            source.weight.copy_((1 + source.weight.float()) / s - 1)
        else:
            source.weight.div_(s.to(source.weight.dtype))
    else:
        source.weight.div_(s.to(source.weight.dtype).unsqueeze(1))
        if source.bias is not None:
            source.bias.div_(s.to(source.bias.dtype))
    for m in linears:
        m.weight.mul_(s.to(m.weight.dtype))


@torch.no_grad()
def awq_scale(model: nn.Module, batches: list[torch.Tensor], quantized: set[str],
              fake_quant: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
    """Search and fold AWQ scales for every fold target with a Linear in ``quantized``; returns name -> alpha."""
    targets = [t for t in fold_targets(model) if any(n in quantized for n in t[2])]
    samples = input_samples(model, [names[0] for _, _, names in targets], batches)
    alphas = {}
    for kind, source, names in targets:
        x_mean, x = samples[names[0]]
        linears = [model.get_submodule(n) for n in names]
        chosen = [m.weight for n, m in zip(names, linears) if n in quantized]
        s, alpha = search_scale(x_mean, x, chosen, fake_quant)
        fold(kind, source, linears, s)
        alphas[names[0]] = alpha
    return alphas


__all__ = ["fold_targets", "input_samples", "search_scale", "fold", "awq_scale"]
