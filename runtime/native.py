"""The native runtime: a genai export's decode steps (and short int8 prompts) in prunus's own CPU kernels
(:mod:`prunus.native`: ``decode.c``, AVX2, compiled on first use), over the same weights and the same KV buffers
as ONNX Runtime's graph, so the two take turns on one cache (:class:`prunus.runtime.genai_session.GenaiSession`
with ``native=True``); the backend is the genai one (:mod:`prunus.runtime.ort_genai`).

The weights are the export's own numbers: read from its graph and repacked (:mod:`prunus.native.weights`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from prunus.native.decoder import NativeDecoder, check_native, native_prompt_tokens  # noqa: F401  (the runtime's API)
from prunus.native.weights import PackedModel, read_genai_graph

from .load_options import LoadOptions
from .ort_genai import GenaiBackend  # noqa: F401  (the backend this runtime loads)
from .registry import Loaded


def pack_graph(source: str | Path | bytes, dims: dict) -> PackedModel:
    """The genai graph at ``source`` (a path, its initializers external or not, or its bytes) packed for the kernels."""
    import onnx

    if isinstance(source, bytes):
        proto, where = onnx.load_model_from_string(source), "the genai graph"
    else:
        proto, where = onnx.load(str(source)), str(source)
    return read_genai_graph(proto, dims, where)


def native_decoder(source, dims: dict, k_buffers: list, v_buffers: list, n_slots: int, max_len: int,
                   threads: int | None = None, packed: PackedModel | None = None) -> NativeDecoder:
    """A decoder over ``k_buffers`` / ``v_buffers`` (one per layer, (n_slots, kv_heads, max_len, head_dim) float32);
    ``packed``: weights already packed by the caller, else read from the graph at ``source``."""
    return NativeDecoder(packed if packed is not None else pack_graph(source, dims), k_buffers, v_buffers, n_slots,
                         max_len, threads)


def every_position_logits(packed: PackedModel, dims: dict, tokens: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """tokens (batch, seq) -> logits (batch, seq, vocab) of every position, through a scratch cache of its own."""
    b, s = tokens.shape
    shape = (b, dims["n_kv_heads"], s, dims["head_dim"])
    k, v = ([np.zeros(shape, np.float32) for _ in range(dims["n_layers"])] for _ in range(2))
    decoder = NativeDecoder(packed, k, v, b, s, threads)
    try:
        logits = np.empty((b * s, dims["vocab_size"]), np.float32)
        decoder.forward(tokens.long().numpy(), np.zeros(b, np.int32), np.full(b, s, np.int32), 0, logits,
                        every_position=True)
    finally:
        decoder.close()
    return torch.from_numpy(logits.reshape(b, s, -1))


def load(path: Path, config: dict, options: LoadOptions) -> Loaded:
    """An ONNX genai export dir whose decode steps run natively (``native=True``)."""
    from .ort_genai import load_genai

    check_native(str(path))
    return load_genai(path, config, options, native=True)
