"""Shard a loaded model for tensor-parallel inference: plain tensors, gpt-fast style.

Megatron's split of each block: wq, wk, wv, w1, w3 column-parallel (a rank keeps
its slice of the output features: n_heads/tp query heads, n_kv_heads/tp key/value
heads, ffn_dim/tp hidden units), wo and w2 row-parallel (its slice of the input
features); then one all-reduce sums the partial outputs of attention and one those
of the MLP. Embedding, norms and the output head stay whole on every rank.

The families' variants: q/k/v biases are sliced with their output rows; a row-parallel
layer's bias (the o projection's) is kept by rank 0 alone, so the all-reduce adds it
once; per-head q/k norms act on each rank's own heads with the whole (shared) weight;
post norms run after the all-reduce, on whole outputs. A mixture-of-experts block
splits every expert's hidden units (``w1`` / ``w3`` columns, ``w2`` rows) and its
shared experts like an MLP; the router stays whole, so every rank routes every token
alike and the weighted partial outputs sum to the whole.

Why plain tensors and not DTensor's ``parallelize_module``: its Colwise/Rowwise plans
handle ``nn.Linear`` and ``nn.Embedding`` only, while a compressed model holds
``QuantizedLinear`` modules (int8 / float8 weights + scales as buffers). Slicing the
tensors at load works for both, keeps the forward pass free of DTensor dispatch (it
matters for decode steps of a few milliseconds), and makes the communication explicit:
exactly the two all-reduces per block. Quantized weights are sliced with their scales:
per-channel and per-group scales follow the output rows of a column-parallel layer;
per-group scales follow the input groups of a row-parallel layer; per-channel scales of
a row-parallel layer and per-tensor scales are the same on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from prunus.artifacts.errors import PrunusError
from prunus.models.moe import MoE

COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROW = ("attention.wo", "feed_forward.w2")


def check_tp(cfg, tp: int, source: str = "the model") -> None:
    """One clear error when ``tp`` cannot split the heads or the MLP (each expert's, for MoE) evenly."""
    mlp = ("moe_ffn_dim", cfg.moe_ffn_dim) if getattr(cfg, "n_experts", 0) else ("ffn_dim", cfg.ffn_dim)
    sizes = (("n_kv_heads", cfg.n_kv_heads), ("n_heads", cfg.n_heads), mlp)
    for name, value in sizes:
        if value % tp:
            choices = [d for d in range(1, cfg.n_kv_heads + 1) if all(v % d == 0 for _, v in sizes)]
            raise PrunusError(f"tp={tp} does not divide {source}'s {name}={value}; choose tp from {', '.join(map(str, choices))}")


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    value = value.clone().contiguous()
    if isinstance(old, nn.Parameter):
        setattr(module, name, nn.Parameter(value, requires_grad=False))
    else:
        setattr(module, name, value)  # a registered buffer stays a buffer


def shard_linear(module: nn.Module, style: str, rank: int, world: int) -> None:
    """Keep this rank's slice of a Linear or QuantizedLinear: ``style`` "column" (outputs) or "row" (inputs)."""
    weight = module.weight
    pack = 2 if weight.dtype == torch.uint8 else 1  # int4 (Int4Linear): two input features per byte
    out_f, in_f = weight.shape[0], weight.shape[1] * pack
    scale = getattr(module, "weight_scale", None)
    zero = getattr(module, "weight_zero", None)  # int4 zero points: (out, n_groups), sliced as the scales
    bias = getattr(module, "bias", None)
    if style == "column":
        n = out_f // world
        _set_tensor(module, "weight", weight[rank * n:(rank + 1) * n])
        if scale is not None and scale.shape[0] == out_f and out_f > 1:
            _set_tensor(module, "weight_scale", scale[rank * n:(rank + 1) * n])
        if zero is not None:
            _set_tensor(module, "weight_zero", zero[rank * n:(rank + 1) * n])
        if bias is not None:
            _set_tensor(module, "bias", bias[rank * n:(rank + 1) * n])
        module.out_features = n
    else:
        if bias is not None and rank != 0:  # the all-reduce of the partial outputs adds rank 0's bias once
            module.bias = None
        n = in_f // world
        _set_tensor(module, "weight", weight[:, rank * n // pack:(rank + 1) * n // pack])
        if scale is not None and scale.ndim == 2 and scale.shape[1] > 1:  # per-group scales along the input
            group = in_f // scale.shape[1]
            if n % group:
                raise PrunusError(f"tp={world} splits {in_f} inputs into {n} per rank, not a multiple of the "
                                  f"quantization group size {group}; choose a smaller tp")
            g = n // group
            _set_tensor(module, "weight_scale", scale[:, rank * g:(rank + 1) * g])
            if zero is not None:
                _set_tensor(module, "weight_zero", zero[:, rank * g:(rank + 1) * g])
        module.in_features = n


def shard_moe(moe: MoE, rank: int, world: int) -> None:
    """Keep this rank's slice of every expert's hidden units (and of the shared experts'); the router stays whole."""
    experts = moe.experts
    n = experts.w1.shape[2] // world
    hidden = slice(rank * n, (rank + 1) * n)
    _set_tensor(experts, "w1", experts.w1[:, :, hidden])
    _set_tensor(experts, "w3", experts.w3[:, :, hidden])
    _set_tensor(experts, "w2", experts.w2[:, hidden, :])
    if moe.shared is not None:
        for name in ("w1", "w3", "w2"):
            shard_linear(getattr(moe.shared, name), "row" if name == "w2" else "column", rank, world)


def shard_model(model, rank: int, world: int, keep_output: bool = True, all_reduce=None):
    """Shard every block in place and add the two all-reduces per block; ``keep_output=False``
    drops the output head (only the rank that samples needs logits). ``all_reduce(t)`` sums
    ``t`` over the ranks in place: ``torch.distributed.all_reduce`` unless given."""
    check_tp(model.config, world)
    reduce = all_reduce or dist.all_reduce

    def all_reduce_output(module, inputs, output):
        reduce(output)
        return output

    for block in model.layers.values():
        moe = isinstance(block.feed_forward, MoE)
        for name in COLUMN + ROW:
            if not (moe and name.startswith("feed_forward.")):
                shard_linear(block.get_submodule(name), "column" if name in COLUMN else "row", rank, world)
        if moe:
            shard_moe(block.feed_forward, rank, world)
        block.attention.register_forward_hook(all_reduce_output)
        block.feed_forward.register_forward_hook(all_reduce_output)
    if not keep_output:
        model.output = None
    return model
