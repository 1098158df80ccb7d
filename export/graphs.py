"""The two graphs an export holds, as plain functions of tensors: prefill and decode.

Both wrap the unmodified :class:`prunus.models.Transformer`. A :class:`GraphCache`
stands in for the model's KV cache: instead of writing into preallocated buffers
it concatenates the past keys/values with the new ones (the ``present`` outputs)
and builds one boolean mask from ``attention_mask`` (1 = real token, 0 = padding,
left padding allowed) and causality within the new tokens. Positions come from
``position_ids``, so a left-padded row rotates its tokens from its own position 0.

A mixture-of-experts block groups its tokens by expert with data-dependent shapes
(counts per expert), which ``torch.export`` cannot trace; :func:`exportable` swaps it for
:class:`DenseMoE`, the same function written with fixed shapes: every expert runs on every
token and a (tokens, experts) gate matrix, zero off each token's top-k, weights and sums
them. That costs n_experts / top_k times the routed experts' work, the price of a static
graph; the outputs equal the routed layer's up to the order of the float sums.

Graph I/O names (the export dir contract):

* prefill: ``input_ids``, ``position_ids``, ``attention_mask`` (batch, seq) ->
  ``logits`` (batch, seq, vocab), ``present.{i}.key|value`` (batch, kv_heads, seq, head_dim)
* decode: ``input_ids``, ``position_ids`` (batch, new), ``attention_mask`` (batch, past + new),
  ``past.{i}.key|value`` (batch, kv_heads, past, head_dim) -> ``logits``, ``present.{i}.key|value``
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from prunus.models.moe import MoE


class DenseMoE(nn.Module):
    """A trained :class:`MoE` layer's inference function with static shapes (see the module docstring)."""

    def __init__(self, moe: MoE):
        super().__init__()
        self.router, self.experts, self.shared = moe.router, moe.experts, moe.shared
        self.top_k, self.norm_topk, self.n_experts = moe.top_k, moe.norm_topk, moe.n_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(-1, experts, weights)  # (batch, seq, E), zero off the top-k
        out = torch.zeros_like(x)
        ex = self.experts
        for e in range(self.n_experts):
            w1, w3, w2 = ex.w1[e].to(x.dtype), ex.w3[e].to(x.dtype), ex.w2[e].to(x.dtype)
            y = (F.silu(x @ w1) * (x @ w3)) @ w2
            out = out + (y.float() * gates[..., e:e + 1]).to(x.dtype)
        return out if self.shared is None else out + self.shared(x)


def exportable(model: nn.Module) -> nn.Module:
    """``model`` with its MoE layers as :class:`DenseMoE` (a copy; ``model`` itself when it has none)."""
    names = [n for n, m in model.named_modules() if isinstance(m, MoE)]
    if not names:
        return model
    model = copy.deepcopy(model)
    for name in names:
        model.set_submodule(name, DenseMoE(model.get_submodule(name)))
    return model


class GraphCache:
    """``prunus.models.kv_cache.KVCacheProtocol`` over explicit past tensors.

    Needs ``update`` (past concatenated with the new keys/values, kept as ``present``) and
    ``attn_mask`` (from ``attention_mask``, see :meth:`attn_mask`). ``advance`` does nothing:
    the graph returns ``present`` and its caller keeps the lengths. ``seq_len`` is None: the
    graphs always pass ``position_ids``."""

    seq_len = None

    def __init__(self, attention_mask: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 layer_ids=()):
        self.attention_mask = attention_mask.bool()
        self.past = dict(zip([int(i) for i in layer_ids], past)) if past else {}
        self.present: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._mask = None

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_id in self.past:
            pk, pv = self.past[layer_id]
            k, v = torch.cat([pk.to(k.dtype), k], dim=2), torch.cat([pv.to(v.dtype), v], dim=2)
        self.present[layer_id] = (k, v)
        return k, v

    def attn_mask(self, q_len: int, k_len: int) -> torch.Tensor:
        """(batch, 1, q_len, k_len): key j is visible to new token i when it is real and j <= past + i.

        Each token also sees itself, so a padding row never has every key masked (no NaN from
        softmax over nothing); padding rows' outputs are never read."""
        if self._mask is None:
            q = torch.arange(q_len, device=self.attention_mask.device).unsqueeze(1) + (k_len - q_len)
            kk = torch.arange(k_len, device=self.attention_mask.device).unsqueeze(0)
            causal = kk <= q
            mask = causal.unsqueeze(0) & self.attention_mask[:, None, :]
            mask = mask | (kk == q).unsqueeze(0)
            self._mask = mask.unsqueeze(1)
        return self._mask

    def advance(self, n: int) -> None:
        pass


def _presents(cache: GraphCache, layer_ids) -> list[torch.Tensor]:
    out = []
    for i in layer_ids:
        k, v = cache.present[int(i)]
        out += [k, v]
    return out


class PrefillGraph(nn.Module):
    """(input_ids, position_ids, attention_mask) -> (logits, present.0.key, present.0.value, ...)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask):
        ids = list(self.model.layers.keys())
        cache = GraphCache(attention_mask, layer_ids=ids)
        logits = self.model(input_ids, cache=cache, positions=position_ids)
        return (logits, *_presents(cache, ids))


class DecodeGraph(nn.Module):
    """(input_ids, position_ids, attention_mask, past.0.key, past.0.value, ...) -> (logits, present...)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask, *past):
        ids = list(self.model.layers.keys())
        pairs = [(past[2 * j], past[2 * j + 1]) for j in range(len(ids))]
        cache = GraphCache(attention_mask, pairs, layer_ids=ids)
        logits = self.model(input_ids, cache=cache, positions=position_ids)
        return (logits, *_presents(cache, ids))


def graph_names(n_layers: int) -> dict[str, list[str]]:
    """ONNX input/output names of both graphs for a model with ``n_layers`` blocks."""
    kv = lambda prefix: [f"{prefix}.{i}.{t}" for i in range(n_layers) for t in ("key", "value")]  # noqa: E731
    return {
        "prefill_inputs": ["input_ids", "position_ids", "attention_mask"],
        "decode_inputs": ["input_ids", "position_ids", "attention_mask", *kv("past")],
        "outputs": ["logits", *kv("present")],
    }
