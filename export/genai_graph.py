"""One ONNX graph for prefill and decode, written from a prunus model's weights (the onnxruntime-genai layout).

Where ``torch.onnx.export`` gives two graphs whose decode step concatenates the whole KV cache
with the new keys every step (:mod:`prunus.export.graphs`), this graph is built node by node
(:mod:`prunus.export.genai_layers`) around ONNX Runtime's fused CPU operators and serves both passes:

inputs
  ``input_ids`` int64 (batch, seq): right-padded prompts, or one new token per row;
  ``seqlens_k`` int32 (batch,): each row's total length after this pass, minus one;
  ``total_sequence_length`` int32 scalar: the longest row's total length after this pass;
  ``past.{i}.key|value`` float32 (batch, kv_heads, max_len, head_dim): the KV buffer
outputs
  ``logits`` float32 (batch, vocab): at each row's last real token only;
  ``present.{i}.key|value``: the same buffer (bind it as both: GroupQueryAttention then writes the
  new keys at each row's own positions and copies nothing).

A pass with ``seq == total_sequence_length`` is a prompt (every row from position 0); ``seq == 1``
with longer rows is a decode step. Positions for the rotary embedding come from ``seqlens_k`` inside
the operator (rows of any lengths in one batch).

Supported: Llama-family decoders as prunus writes them (any rope scaling, GQA, q/k/v and output
biases, a custom attention scale, sliding windows, tied or untied heads). Anything else (mixture of
experts, q/k norms, soft-capping, GELU gates, (1 + w) norms, scaled embeddings, post-norms) is
refused by :func:`check_genai_support` in one line, and export falls back to the torch graphs.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from prunus.artifacts.errors import PrunusError
from prunus.models.rope import rope_halves

from .genai_layers import MS_DOMAIN, GraphWriter

GENAI_GRAPH = "model.onnx"
GENAI_OPSET = 23  # as the torch graphs for ONNX Runtime; 21 is the least (blocked DequantizeLinear of stored int8)
GENAI_IR_VERSION = 10


def unsupported_features(cfg, modules: dict | None = None, precision: str = "fp32") -> list[str]:
    """What in this model the genai graph does not build (empty: supported): the architecture the native kernels do
    not mirror either (:func:`prunus.runtime.native_tensors.unmirrored`), and the precision."""
    from prunus.runtime.native_tensors import unmirrored

    checks = [
        (precision not in ("fp32", "int8", "int4"), f"{precision} weights"),
        (any(m.scheme.startswith("fp8") for m in (modules or {}).values()), "fp8 weights"),
    ]
    return unmirrored(cfg) + [what for bad, what in checks if bad]


def check_genai_support(cfg, modules: dict | None = None, precision: str = "fp32") -> None:
    """Raise one PrunusError line naming what the genai graph does not support in this model."""
    missing = unsupported_features(cfg, modules, precision)
    if missing:
        raise PrunusError(f"the genai graph does not support {', '.join(missing)}; export with graph='torch' "
                          "(--graph torch)")


def _value(name: str, elem: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _io(cfg, n_layers: int, logits_shape: list) -> tuple[list, list]:
    kv = ["batch", cfg.n_kv_heads, "max_len", cfg.head_dim]
    inputs = [_value("input_ids", TensorProto.INT64, ["batch", "seq"]),
              _value("seqlens_k", TensorProto.INT32, ["batch"]),
              _value("total_sequence_length", TensorProto.INT32, [])]
    outputs = [_value("logits", TensorProto.FLOAT, logits_shape)]
    for i in range(n_layers):
        for t in ("key", "value"):
            inputs.append(_value(f"past.{i}.{t}", TensorProto.FLOAT, kv))
            outputs.append(_value(f"present.{i}.{t}", TensorProto.FLOAT, kv))
    return inputs, outputs


def build_genai_graph(model, packed: bool = True, opset: int = GENAI_OPSET) -> onnx.ModelProto:
    """The genai graph of a plain (float) prunus ``Transformer``; layer indices renumbered 0..n-1.

    ``packed``: q, k and v as one MatMul and gate and up as another (split after), as onnxruntime-genai packs
    them; False: one MatMul per Linear (each then matches its own stored quantized module). Packed steps are a
    little faster (docs/defaults.md); the logits are the same either way (each output column is its own dot
    product)."""
    cfg = model.config
    check_genai_support(cfg)
    w = GraphWriter(cfg, packed, packed)
    cos, sin = rope_halves(cfg)
    cache = {"seqlens_k": "seqlens_k", "total": "total_sequence_length",
             "cos": w.init("rope.cos", cos), "sin": w.init("rope.sin", sin)}
    emb = w.init("tok_embeddings.weight", model.tok_embeddings.weight)
    (h,) = w.node("Gather", [emb, "input_ids"], name="tok_embeddings/Gather")
    layers = list(model.layers.values())
    x = w.norm(h, layers[0].attention_norm.weight, "layers.0.attention_norm")
    for i, block in enumerate(layers):
        a = w.attention(x, block.attention, i, cache)
        x, h = w.skip_norm(a, h, block.ffn_norm.weight, f"layers.{i}.ffn_norm")
        f = w.feed_forward(x, block.feed_forward, i)
        nxt = layers[i + 1].attention_norm if i + 1 < len(layers) else model.norm
        x, h = w.skip_norm(f, h, nxt.weight, f"layers.{i + 1}.attention_norm" if i + 1 < len(layers) else "norm")
    y = w.last_token(x, "input_ids", "seqlens_k")
    if model.output.weight is model.tok_embeddings.weight:  # tied: one copy in the file, read transposed by the head
        # (a compressed dir whose head was untied and quantized has its own output module, config flag or not)
        (head,) = w.node("Transpose", [emb], name="output/Transpose", perm=[1, 0])
        w.node("MatMul", [y, head], name="output/MatMul", outputs=["logits"])
    else:
        w.node("MatMul", [y, w.init("output.weight", model.output.weight.detach().float().t())],
                           name="output/MatMul", outputs=["logits"])
    inputs, outputs = _io(cfg, len(layers), ["batch", cfg.vocab_size])
    graph = helper.make_graph(w.nodes, "prunus-genai", inputs, outputs, w.inits)
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(MS_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=GENAI_IR_VERSION, producer_name="prunus")


def save_genai_graph(model: onnx.ModelProto, path: Path, external_data: bool) -> None:
    """Write the graph (weights in ``<name>.data`` when ``external_data``). No ``onnx.checker`` pass: it does not
    know ONNX Runtime's SimplifiedLayerNormalization; the session load in the parity check is the check."""
    if external_data:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=Path(path).name + ".data", size_threshold=1024)
    else:
        onnx.save_model(model, str(path))


def quantized_genai_graph(model, modules: dict, precision: str, tmp: Path, external: bool, style: str,
                          int4_style: str, opset: int = GENAI_OPSET) -> Path:
    """Write the genai graph of ``model`` at ``precision`` to ``tmp / GENAI_GRAPH``; returns the path.

    * stored weights (``modules``: a compressed dir's QuantizedLinear / Int4Linear): the graph is built from
      their dequantized values with one MatMul per module, then each gets its stored integers back
      (:func:`~prunus.export.quantize_onnx.apply_stored_quantization`: MatMulNBits for int4, ``style`` for int8);
    * ``int8`` / ``int4`` of a float model: ONNX Runtime's MatMulNBitsQuantizer on the fp32 graph
      (:func:`~prunus.export.quantize_onnx.quantize_fp32_graph`), the output head included (a tied head is
      untied for it; the embedding stays a float Gather).

    The native decoder's copy of the same numbers goes beside it (:mod:`prunus.export.native_weights`)."""
    from .native_weights import write_native_weights
    from .onnx_export import dequantized_copy
    from .quantize_onnx import apply_stored_quantization, quantize_fp32_graph

    path = tmp / GENAI_GRAPH
    if modules:
        proto = build_genai_graph(dequantized_copy(model, modules), packed=False, opset=opset)
        apply_stored_quantization(proto, modules, style, int4_style)
        save_genai_graph(proto, path, external)
    elif precision in ("int8", "int4"):
        fp32 = tmp / f".{GENAI_GRAPH}.fp32.onnx"
        save_genai_graph(build_genai_graph(model, opset=opset), fp32, external)
        quantize_fp32_graph(fp32, path, external, bits=4 if precision == "int4" else 8)
        for f in tmp.glob(f".{GENAI_GRAPH}.fp32.onnx*"):
            f.unlink()
    else:
        save_genai_graph(build_genai_graph(model, opset=opset), path, external)
    write_native_weights(model, tmp, modules, precision, style, int4_style)
    return path


def genai_dims(model) -> dict:
    """What a runner needs to size its buffers (recorded in the export dir's config.json)."""
    cfg = model.config
    return {"n_layers": len(model.layers), "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size}

