"""The native kernels' weights of a transformer: the tensors and metadata of :data:`NATIVE_WEIGHTS`
(:mod:`prunus.artifacts.native_layout`), computed from a loaded model.

One computation serves both places the kernels' weights come from: ``prunus export --graph genai`` writes them beside
its graph (:mod:`prunus.export.native_weights`, which says how each stored module is held in that graph), and the
native runtime packs a model dir's own in memory at load (:func:`model_dir_tensors`, :mod:`prunus.runtime.native_backend`),
no export written. Either way:

* a compressed model's stored modules: their int4 packed codes, scales and integer zero points, and int8 codes,
  exactly as stored in ``model.safetensors``; the rest of the model in float, one linear layer per module;
* a float model quantized on the way (an export at ``--precision int8`` / ``int4``): the codes the caller's
  ``codes(weight, bits)`` gives, q / k / v and gate / up packed, the tied head quantized as its own layer;
* a float model: the float weights, the tied head stored once (as the embedding).

A module the kernels do not mirror leaves no tensors and metadata saying why (``unsupported``), so that loading it
natively is one line naming it (:func:`prunus.native.weights.pack_tensors`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from prunus.artifacts.native_layout import NATIVE_FORMAT
from prunus.models.rope import rope_halves

# how a stored module's form is named where the kernels do not take it
FORMS = {"qdq4": "INT4 DequantizeLinear", "integer": "DynamicQuantizeMatMul", "qdq": "QDQ"}


class Unsupported(Exception):
    """A layer the native kernels do not mirror (its message says which and why)."""


@dataclass(frozen=True)
class Source:
    """Where a linear layer's numbers come from: ``stored`` modules by identity, each held in the form
    ``form(module)`` gives ("nbits4": int4 codes, "nbits8": int8 codes, anything else: not the kernels'), or the
    ``bits``-bit codes ``codes(weight (k, n), bits) -> (codes, scales)`` gives of a float weight (None: float)."""

    stored: dict
    form: Callable
    bits: int | None = None
    codes: Callable | None = None


def _array(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy())


def _stored(prefix: str, m, src: Source) -> dict:
    """The stored codes of a quantized module, in the form the caller holds them."""
    form = src.form(m)
    out = {}
    if form == "nbits4" and not getattr(m, "float_zero", False):
        out[f"{prefix}.q4"] = _array(m.weight)
        if not m.symmetric:  # a symmetric module stores no zero points: the storage's midpoint, 8
            out[f"{prefix}.zero"] = _array(m.weight_zero.to(torch.uint8))
    elif form == "nbits8":
        out[f"{prefix}.q8"] = _array((m.weight.to(torch.int16) + 128).to(torch.uint8))
    else:
        how = "float zero points" if form == "nbits4" else FORMS.get(form, f"the {m.scheme} scheme")
        raise Unsupported(f"holds {prefix} ({m.scheme}) as {how}")
    out[f"{prefix}.scale"] = _array(m.weight_scale.float())
    if m.bias is not None:
        out[f"{prefix}.bias"] = _array(m.bias.float())
    return out


def _linear(prefix: str, weight: torch.Tensor, bias: torch.Tensor | None, src: Source) -> dict:
    """A float linear layer (n, k): its weight, or the codes of it."""
    n, k = weight.shape
    w = weight.detach().float()
    if src.bits is None:
        if k % 8:
            raise Unsupported(f"has {prefix} over {k} inputs; the float kernel takes multiples of 8")
        out = {f"{prefix}.weight": _array(w)}
    else:
        if k % 32:
            raise Unsupported(f"has {prefix} over {k} inputs; the integer kernels take multiples of 32")
        codes, scales = src.codes(_array(w.t()), src.bits)
        out = {f"{prefix}.q{src.bits}": codes.reshape(n, -1), f"{prefix}.scale": scales.reshape(n, -1)}
    if bias is not None:
        out[f"{prefix}.bias"] = _array(bias.float())
    return out


def _module(prefix: str, m, src: Source) -> dict:
    if id(m) in src.stored:
        return _stored(prefix, m, src)
    return _linear(prefix, m.weight, m.bias, src)


def _cat(mods) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = torch.cat([m.weight for m in mods], 0)
    return w, None if mods[0].bias is None else torch.cat([m.bias for m in mods], 0)


def _layer(i: int, block, src: Source, packed: bool) -> dict:
    """One block's tensors, its linear layers packed (q / k / v, gate / up) where ``packed``."""
    attn, ff = block.attention, block.feed_forward
    p, f = f"layers.{i}.attention", f"layers.{i}.feed_forward"
    out = {f"layers.{i}.attention_norm.weight": _array(block.attention_norm.weight.float()),
           f"layers.{i}.ffn_norm.weight": _array(block.ffn_norm.weight.float())}
    if packed:
        out.update(_linear(f"{p}.wqkv", *_cat([attn.wq, attn.wk, attn.wv]), src))
        out.update(_linear(f"{f}.w13", _cat([ff.w1, ff.w3])[0], None, src))
    else:
        for name in ("wq", "wk", "wv"):
            out.update(_module(f"{p}.{name}", getattr(attn, name), src))
        for name in ("w1", "w3"):
            out.update(_module(f"{f}.{name}", getattr(ff, name), src))
    out.update(_module(f"{p}.wo", attn.wo, src))
    out.update(_module(f"{f}.w2", ff.w2, src))
    return out


def _window(cfg, block) -> int:
    window = cfg.layer_window(block.attention.layer_id)  # as the genai graph's local_window_size
    return -1 if window is None else int(window)


def unmirrored(cfg) -> list[str]:
    """What in a model's architecture neither the genai graph nor the native kernels build (empty: they mirror it;
    :func:`prunus.export.genai_graph.unsupported_features` adds the precisions)."""
    checks = [
        (cfg.n_experts > 0, "mixture of experts"), (cfg.qk_norm, "q/k norms"),
        (cfg.attn_softcap is not None, "attention soft-capping"), (cfg.final_softcap is not None, "logit soft-capping"),
        (cfg.hidden_act != "silu", f"{cfg.hidden_act} gates"), (cfg.norm_one_plus_weight, "(1 + w) norms"),
        (cfg.scale_embeddings, "scaled embeddings"), (cfg.post_norms, "post-norms"),
    ]
    return [what for bad, what in checks if bad]


def tensors_of(model, src: Source) -> tuple[dict, dict]:
    """(tensors, metadata) of :data:`NATIVE_WEIGHTS` for ``model``, its numbers from ``src``."""
    cfg, layers = model.config, list(model.layers.values())
    missing = unmirrored(cfg)
    if missing:
        return {}, {"format": NATIVE_FORMAT, "unsupported": f"has {', '.join(missing)}"}
    tied = (id(model.output) not in src.stored and src.bits is None
            and model.output.weight is model.tok_embeddings.weight)
    meta = {"format": NATIVE_FORMAT, "n_heads": str(cfg.n_heads), "eps": repr(float(cfg.norm_eps)),
            "scale": repr(float(cfg.attn_scale)), "tied_head": "true" if tied else "false",
            "windows": ",".join(str(_window(cfg, b)) for b in layers)}
    try:
        cos, sin = rope_halves(cfg)
        tensors = {"tok_embeddings.weight": _array(model.tok_embeddings.weight.float()),
                   "norm.weight": _array(model.norm.weight.float()), "rope.cos": _array(cos), "rope.sin": _array(sin)}
        for i, block in enumerate(layers):
            tensors.update(_layer(i, block, src, packed=not src.stored))
        if not tied:
            tensors.update(_module("output", model.output, src))
    except Unsupported as e:
        return {}, {"format": NATIVE_FORMAT, "unsupported": str(e)}
    return tensors, meta


def model_dir_form(module) -> str:
    """How the native runtime holds a model dir's stored module: int4 weight-only as int4 codes, int8 weight-only as
    int8 codes (as a genai export writes them, MatMulNBits bits 4 / 8); a scheme that quantizes activations (w8a8,
    fp8) is not the kernels'."""
    return {"int4-weight-only": "nbits4", "int8-weight-only": "nbits8"}.get(module.scheme, module.scheme)


def model_dir_tensors(model) -> tuple[dict, dict]:
    """(tensors, metadata) of a loaded model dir's model at its own precision: float weights, or its stored int8 /
    int4 modules' codes (the tensors a genai export of the dir writes, :mod:`prunus.export.native_weights`)."""
    from prunus.models.quant_registry import quantized_modules

    modules = quantized_modules(model)
    return tensors_of(model, Source({id(m): m for m in modules.values()}, model_dir_form))
