"""``native_weights.safetensors``: the native decoder's weights, written beside a genai export's graph.

The native decoder (:mod:`prunus.native`) must run the export's own numbers without reading its graph. So the
export writes them once more, in the plain layout of :mod:`prunus.artifacts.native_layout`, from the same tensors
the graph is built from (:mod:`prunus.export.genai_graph`; computed by :mod:`prunus.runtime.native_tensors`, which
packs a model dir's own the same way when the native runtime serves it directly):

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

from pathlib import Path

from safetensors.numpy import save_file

from prunus.artifacts.native_layout import NATIVE_WEIGHTS
from prunus.runtime.native_tensors import Source, tensors_of

from .quantize_onnx import nbits8_applies, ort_block_codes, stored_form


def native_tensors(model, modules: dict | None = None, precision: str = "fp32", style: str = "matmulnbits",
                   int4_style: str = "matmulnbits") -> tuple[dict, dict]:
    """(tensors, metadata) of :data:`NATIVE_WEIGHTS` for the genai graph
    :func:`~prunus.export.genai_graph.quantized_genai_graph` writes from the same arguments: each stored module in
    the form the graph holds it (:func:`~prunus.export.quantize_onnx.stored_form`), a float model at int8 / int4 in
    ONNX Runtime's codes (:func:`~prunus.export.quantize_onnx.ort_block_codes`)."""
    modules = modules or {}
    bits = {"int8": 8, "int4": 4}.get(precision) if not modules else None
    nbits8 = nbits8_applies(modules, style, int4_style)
    src = Source({id(m): m for m in modules.values()}, lambda m: stored_form(m, style, int4_style, nbits8), bits,
                 ort_block_codes)
    return tensors_of(model, src)


def write_native_weights(model, out_dir: str | Path, modules: dict | None = None, precision: str = "fp32",
                         style: str = "matmulnbits", int4_style: str = "matmulnbits") -> Path:
    """Write ``out_dir / native_weights.safetensors`` for the genai graph of the same arguments beside it."""
    tensors, meta = native_tensors(model, modules, precision, style, int4_style)
    path = Path(out_dir) / NATIVE_WEIGHTS
    save_file(tensors, str(path), metadata=meta)
    return path
