"""``native_weights.safetensors``: the native decoder's weights, written beside a genai export's graph.

The native decoder (:mod:`prunus.native`) must run the export's own numbers without reading its graph. So the
export writes them once more, in the plain layout of :mod:`prunus.artifacts.native_layout`, from the same tensors
the graph is built from (:mod:`prunus.export.genai_graph`):

* a compressed model dir's stored modules: their int4 packed codes, scales and integer zero points, and the int8
  codes of the modules the graph holds as ``MatMulNBits`` bits 8 (:func:`~prunus.export.quantize_onnx.stored_form`),
  exactly as stored in ``model.safetensors``; the rest of the model in float, one linear layer per module as the
  graph has them;
* a float model at ``--precision int8`` / ``int4``: the codes ONNX Runtime's quantizer puts in the graph, from
  the function it calls (:func:`~prunus.export.quantize_onnx.ort_block_codes`), q / k / v and gate / up packed
  as that graph packs them, the tied head quantized as its own layer;
* an fp32 export: the float weights, the tied head stored once (as the embedding).

Norms, the embedding and the rotary tables are the graph's. A module the kernels do not mirror (int8 as QDQ or
``DynamicQuantizeMatMul``, w8a8 or fp8 schemes, float zero points) leaves a file of no tensors whose metadata
says why, so that ``--native`` is one line naming it. The export dir stays self-contained: serving it natively
needs neither its graph's initializers nor the model dir.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

from prunus.artifacts.native_layout import NATIVE_FORMAT, NATIVE_WEIGHTS
from prunus.models.rope import rope_halves

from .quantize_onnx import nbits8_applies, ort_block_codes, stored_form


class _Unsupported(Exception):
    """A layer the native kernels do not mirror (its message says which and why)."""


@dataclass(frozen=True)
class _Source:
    """Where a linear layer's numbers come from: ``stored`` modules by identity (with the int8 / int4 styles the
    graph writes them in), or ONNX Runtime's ``bits``-bit quantization of the float weight (None: float)."""

    stored: dict
    style: str
    int4_style: str
    nbits8: bool
    bits: int | None


def _array(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy())


def _stored(prefix: str, m, src: _Source) -> dict:
    """The stored codes of a quantized module, in the form the graph holds them."""
    form = stored_form(m, src.style, src.int4_style, src.nbits8)
    out = {}
    if form == "nbits4" and not getattr(m, "float_zero", False):
        out[f"{prefix}.q4"] = _array(m.weight)
        if not m.symmetric:  # a symmetric module's graph writes no zero points: MatMulNBits' default 8
            out[f"{prefix}.zero"] = _array(m.weight_zero.to(torch.uint8))
    elif form == "nbits8":
        out[f"{prefix}.q8"] = _array((m.weight.to(torch.int16) + 128).to(torch.uint8))
    else:
        how = "float zero points" if form == "nbits4" else {"qdq4": "INT4 DequantizeLinear", "integer":
                                                              "DynamicQuantizeMatMul"}.get(form, "QDQ")
        raise _Unsupported(f"holds {prefix} ({m.scheme}) as {how}")
    out[f"{prefix}.scale"] = _array(m.weight_scale.float())
    if m.bias is not None:
        out[f"{prefix}.bias"] = _array(m.bias.float())
    return out


def _linear(prefix: str, weight: torch.Tensor, bias: torch.Tensor | None, src: _Source) -> dict:
    """A float linear layer (n, k): its weight, or ONNX Runtime's codes of it."""
    n, k = weight.shape
    w = weight.detach().float()
    if src.bits is None:
        if k % 8:
            raise _Unsupported(f"has {prefix} over {k} inputs; the float kernel takes multiples of 8")
        out = {f"{prefix}.weight": _array(w)}
    else:
        if k % 32:
            raise _Unsupported(f"has {prefix} over {k} inputs; the integer kernels take multiples of 32")
        codes, scales = ort_block_codes(_array(w.t()), src.bits)
        out = {f"{prefix}.q{src.bits}": codes.reshape(n, -1), f"{prefix}.scale": scales.reshape(n, -1)}
    if bias is not None:
        out[f"{prefix}.bias"] = _array(bias.float())
    return out


def _module(prefix: str, m, src: _Source) -> dict:
    if id(m) in src.stored:
        return _stored(prefix, m, src)
    return _linear(prefix, m.weight, m.bias, src)


def _cat(mods) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = torch.cat([m.weight for m in mods], 0)
    return w, None if mods[0].bias is None else torch.cat([m.bias for m in mods], 0)


def _layer(i: int, block, src: _Source, packed: bool) -> dict:
    """One block's tensors, its linear layers packed (q / k / v, gate / up) where the graph packs them."""
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
    window = cfg.layer_window(block.attention.layer_id)  # as the graph's local_window_size
    return -1 if window is None else int(window)


def native_tensors(model, modules: dict | None = None, precision: str = "fp32", style: str = "matmulnbits",
                   int4_style: str = "matmulnbits") -> tuple[dict, dict]:
    """(tensors, metadata) of :data:`NATIVE_WEIGHTS` for the genai graph
    :func:`~prunus.export.genai_graph.quantized_genai_graph` writes from the same arguments."""
    modules = modules or {}
    cfg, layers = model.config, list(model.layers.values())
    bits = {"int8": 8, "int4": 4}.get(precision) if not modules else None
    src = _Source({id(m): m for m in modules.values()}, style, int4_style, nbits8_applies(modules, style, int4_style),
                  bits)
    tied = id(model.output) not in src.stored and bits is None and model.output.weight is model.tok_embeddings.weight
    meta = {"format": NATIVE_FORMAT, "n_heads": str(cfg.n_heads), "eps": repr(float(cfg.norm_eps)),
            "scale": repr(float(cfg.attn_scale)), "tied_head": "true" if tied else "false",
            "windows": ",".join(str(_window(cfg, b)) for b in layers)}
    try:
        cos, sin = rope_halves(cfg)
        tensors = {"tok_embeddings.weight": _array(model.tok_embeddings.weight.float()),
                   "norm.weight": _array(model.norm.weight.float()), "rope.cos": _array(cos), "rope.sin": _array(sin)}
        for i, block in enumerate(layers):
            tensors.update(_layer(i, block, src, packed=not modules))
        if not tied:
            tensors.update(_module("output", model.output, src))
    except _Unsupported as e:
        return {}, {"format": NATIVE_FORMAT, "unsupported": str(e)}
    return tensors, meta


def write_native_weights(model, out_dir: str | Path, modules: dict | None = None, precision: str = "fp32",
                         style: str = "matmulnbits", int4_style: str = "matmulnbits") -> Path:
    """Write ``out_dir / native_weights.safetensors`` for the genai graph of the same arguments beside it."""
    tensors, meta = native_tensors(model, modules, precision, style, int4_style)
    path = Path(out_dir) / NATIVE_WEIGHTS
    save_file(tensors, str(path), metadata=meta)
    return path
