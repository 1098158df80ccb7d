"""The genai export as onnxruntime-genai's own runtime loads it: ``genai_config.json`` + ``genai_model.onnx``.

prunus's genai graph (:mod:`prunus.export.genai_graph`) takes ``seqlens_k`` / ``total_sequence_length`` and
returns the last position's logits. onnxruntime-genai's model builder lays a decoder out differently, and
``onnxruntime_genai.Model(dir)`` reads that layout from ``genai_config.json``:

inputs
  ``input_ids`` int64 (batch, seq); ``attention_mask`` int64 (batch, total length);
  ``past_key_values.{i}.key|value`` float32 (batch, kv_heads, max_length, head_dim) (a shared buffer)
outputs
  ``logits`` float32 (batch, seq, vocab); ``present.{i}.key|value`` (the same buffer)

This module writes a second graph in that layout beside the first: the same nodes (GroupQueryAttention with
its rotary embedding, the stored or quantized weights as they are), every position's logits, and at the front
the two nodes the builder writes (``seqlens_k = ReduceSum(attention_mask) - 1``, ``total_sequence_length =
Shape(attention_mask)[1]``). The weights are not copied: the graph points at the same external data file (or
embeds them where the export has none). ``genai_config.json`` names the graph, its I/O, the shapes, the special
token ids and greedy search defaults with ``past_present_share_buffer`` (the KV buffer is ``max_seq_len`` long).
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from prunus.runtime.genai_prompt_graph import all_positions_graph

from .genai_graph import GENAI_GRAPH

COMPAT_GRAPH = "genai_model.onnx"
COMPAT_CONFIG = "genai_config.json"


def _rename_past(graph: onnx.GraphProto) -> None:
    renames = {}
    for value in graph.input:
        if value.name.startswith("past."):
            new = "past_key_values." + value.name[len("past."):]
            renames[value.name] = new
            value.name = new
    for node in graph.node:
        for j, name in enumerate(node.input):
            if name in renames:
                node.input[j] = renames[name]


def compat_graph(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A prunus genai graph (any precision) with onnxruntime-genai's I/O names and every position's logits."""
    out = all_positions_graph(proto)
    g = out.graph
    _rename_past(g)
    kept = [v for v in g.input if v.name not in ("seqlens_k", "total_sequence_length")]
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total_sequence_length"])
    del g.input[:]
    g.input.extend([kept[0], mask, *kept[1:]])
    one = helper.make_tensor("genai_compat.one", TensorProto.INT64, [], [1])
    axes = helper.make_tensor("genai_compat.axes", TensorProto.INT64, [1], [1])
    g.initializer.extend([one, axes])
    front = [
        helper.make_node("ReduceSum", ["attention_mask", axes.name], ["genai_compat.lengths"],
                         name="attention_mask/ReduceSum", keepdims=0),
        helper.make_node("Sub", ["genai_compat.lengths", one.name], ["genai_compat.last"], name="attention_mask/Sub"),
        helper.make_node("Cast", ["genai_compat.last"], ["seqlens_k"], name="seqlens_k/Cast", to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["genai_compat.shape"], name="attention_mask/Shape"),
        helper.make_node("Gather", ["genai_compat.shape", one.name], ["genai_compat.total"],
                         name="attention_mask/Gather", axis=0),
        helper.make_node("Cast", ["genai_compat.total"], ["total_sequence_length"], name="total_sequence_length/Cast",
                         to=TensorProto.INT32),
    ]
    nodes = list(g.node)
    del g.node[:]
    g.node.extend(front + nodes)
    return out


def genai_config(cfg, n_layers: int, tokenizer) -> dict:
    """The ``genai_config.json`` onnxruntime-genai's builder writes, for this export's graph."""
    eos = getattr(tokenizer, "eos_id", None)
    stops = [i for i in (getattr(tokenizer, "stop_ids", None) or []) if i is not None] or ([eos] if eos is not None else [])
    named = getattr(tokenizer, "token_id", None)  # HFTokenizer: the special tokens tokenizer_config.json names
    bos = named("bos_token") if named else None
    pad = named("pad_token") if named else None
    return {
        "model": {
            "bos_token_id": bos if bos is not None else (eos if eos is not None else 0),
            "context_length": cfg.max_seq_len,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": COMPAT_GRAPH, "head_size": cfg.head_dim, "hidden_size": cfg.dim,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": cfg.n_heads, "num_hidden_layers": n_layers,
                "num_key_value_heads": cfg.n_kv_heads,
            },
            "eos_token_id": stops[0] if len(stops) == 1 else stops,
            "pad_token_id": pad if pad is not None else (stops[0] if stops else 0),
            "type": "llama",
            "vocab_size": cfg.vocab_size,
        },
        "search": {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
                   "max_length": cfg.max_seq_len, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
                   "num_return_sequences": 1, "past_present_share_buffer": True, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }


def write_genai_compat(tmp: Path, model, tokenizer) -> None:
    """Write ``genai_model.onnx`` (sharing ``model.onnx``'s external data) and ``genai_config.json`` into ``tmp``."""
    proto = onnx.load_model(str(tmp / GENAI_GRAPH), load_external_data=False)
    onnx.save_model(compat_graph(proto), str(tmp / COMPAT_GRAPH))
    config = genai_config(model.config, len(model.layers), tokenizer)
    (tmp / COMPAT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
