"""Tensor names and layouts between a Hugging Face family's checkpoint and prunus's Transformer.

Only renames, splits, joins and transposes: no value is ever cast or recomputed, so
``state_to_hf(state_from_hf(x)) == x`` bit for bit.

* Phi-3: ``qkv_proj`` is q, k and v stacked along the output dim; ``gate_up_proj`` the gate
  (w1) then the up projection (w3). Split on import, joined on export.
* MoE: Hugging Face stores one (hidden, dim) gate / up and one (dim, hidden) down matrix per
  expert on disk (``{block}.experts.{e}.{name}.weight``); transformers 5 holds them fused in
  memory (``mlp.experts.gate_up_proj`` (E, 2 * hidden, dim), ``mlp.experts.down_proj``
  (E, dim, hidden)), and checkpoints saved that way are read too. prunus's ``GroupedExperts``
  keeps them stacked for a batched matmul: w1 / w3 (E, dim, hidden), w2 (E, hidden, dim), i.e.
  transposed. Exports write the per-expert layout, as ``save_pretrained`` does.
"""

from __future__ import annotations

import re

import torch

from .config import ModelConfig
from prunus.artifacts.errors import PrunusError
from .hf_families import TOP, Family

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _pop(d: dict, *names: str):
    for n in names:
        if n in d:
            return d.pop(n)
    return None


def _experts_from_hf(fam: Family, cfg: ModelConfig, rest: dict) -> dict[str, torch.Tensor]:
    prefix, gate, down, up = fam.experts
    out = {}
    router = _pop(rest, f"{prefix}.gate.weight", "mlp.gate.weight")
    if router is not None:
        out["feed_forward.router.weight"] = router
    per = [[f"{prefix}.experts.{e}.{n}.weight" for e in range(cfg.n_experts)] for n in (gate, down, up)]
    if all(n in rest for names in per for n in names):
        w1, w2, w3 = ([rest.pop(n).t() for n in names] for names in per)
        out["feed_forward.experts.w1"] = torch.stack(w1).contiguous()
        out["feed_forward.experts.w2"] = torch.stack(w2).contiguous()
        out["feed_forward.experts.w3"] = torch.stack(w3).contiguous()
    gate_up, down_fused = _pop(rest, "mlp.experts.gate_up_proj"), _pop(rest, "mlp.experts.down_proj")
    if gate_up is not None and down_fused is not None:  # transformers 5's in-memory layout
        g, u = gate_up.chunk(2, dim=1)
        out["feed_forward.experts.w1"] = g.transpose(1, 2).contiguous()
        out["feed_forward.experts.w3"] = u.transpose(1, 2).contiguous()
        out["feed_forward.experts.w2"] = down_fused.transpose(1, 2).contiguous()
    return out


def _layer_from_hf(fam: Family, cfg: ModelConfig, tensors: dict) -> tuple[dict, list[str]]:
    """One block's tensors (names after ``model.layers.N.``) -> prunus names, and the names left unrecognised."""
    rest, out = dict(tensors), {}
    hd = cfg.head_dim
    if fam.fused:
        qkv, gate_up = _pop(rest, "self_attn.qkv_proj.weight"), _pop(rest, "mlp.gate_up_proj.weight")
        if qkv is not None:
            sizes = [cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd]
            if qkv.shape[0] != sum(sizes):
                raise PrunusError(f"qkv_proj has {qkv.shape[0]} rows, the config says {sum(sizes)} (q, k, v)")
            for name, t in zip(("wq", "wk", "wv"), torch.split(qkv, sizes)):
                out[f"attention.{name}.weight"] = t.contiguous()
        if gate_up is not None:
            w1, w3 = gate_up.chunk(2, dim=0)
            out["feed_forward.w1.weight"], out["feed_forward.w3.weight"] = w1.contiguous(), w3.contiguous()
    if fam.experts:
        out.update(_experts_from_hf(fam, cfg, rest))
    for name in list(rest):
        if name in fam.layer:
            out[fam.layer[name]] = rest.pop(name)
    return out, list(rest)


def state_from_hf(fam: Family, cfg: ModelConfig, hf_state: dict[str, torch.Tensor]) -> tuple[dict, list[str]]:
    """(prunus state dict, unrecognised Hugging Face names). A tied ``lm_head`` is dropped."""
    blocks: dict[int, dict] = {}
    state, unknown = {}, []
    for name, t in hf_state.items():
        m = _LAYER_NAME.fullmatch(name)
        if m:
            blocks.setdefault(int(m[1]), {})[m[2]] = t
        elif name in TOP:
            if not (cfg.tie_embeddings and name == "lm_head.weight"):
                state[TOP[name]] = t
        elif not name.endswith("rotary_emb.inv_freq"):  # old checkpoints store the rope table
            unknown.append(name)
    for i, tensors in sorted(blocks.items()):
        ours, left = _layer_from_hf(fam, cfg, tensors)
        state.update({f"layers.{i}.{k}": v for k, v in ours.items()})
        unknown += [f"model.layers.{i}.{k}" for k in left]
    return state, unknown


def _layer_to_hf(fam: Family, tensors: dict) -> dict[str, torch.Tensor]:
    rest, out = dict(tensors), {}
    if fam.fused:
        out["self_attn.qkv_proj.weight"] = torch.cat([rest.pop(f"attention.{n}.weight") for n in ("wq", "wk", "wv")])
        out["mlp.gate_up_proj.weight"] = torch.cat([rest.pop("feed_forward.w1.weight"), rest.pop("feed_forward.w3.weight")])
    if fam.experts:
        prefix, gate, down, up = fam.experts
        out[f"{prefix}.gate.weight"] = rest.pop("feed_forward.router.weight")
        for ours, theirs in (("w1", gate), ("w2", down), ("w3", up)):
            for e, w in enumerate(rest.pop(f"feed_forward.experts.{ours}")):
                out[f"{prefix}.experts.{e}.{theirs}.weight"] = w.t().contiguous()
    inverse = {v: k for k, v in fam.layer.items()}
    for name, t in rest.items():
        if name not in inverse:
            raise PrunusError(f"tensor {name} has no {fam.model_type} equivalent")
        out[inverse[name]] = t
    return out


def state_to_hf(fam: Family, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """prunus state dict (as saved: a tied output head left out) -> the family's tensor names."""
    blocks: dict[int, dict] = {}
    inverse_top = {v: k for k, v in TOP.items()}
    out = {}
    for name, t in state.items():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            blocks.setdefault(int(i), {})[rest] = t
        else:
            out[inverse_top[name]] = t
    for i, tensors in sorted(blocks.items()):
        out.update({f"model.layers.{i}.{k}": v for k, v in _layer_to_hf(fam, tensors).items()})
    return out
