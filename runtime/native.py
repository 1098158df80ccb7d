"""The native kernels as a parity check runs them (:mod:`prunus.export.genai_parity`): every position's logits of a
batch of tokens through a scratch cache (:func:`every_position_logits`), over a genai export's native weights
(:func:`pack_export`). The native runtime that serves is :mod:`prunus.runtime.native_backend`.

The weights are the export's own numbers, read from the ``native_weights.safetensors`` it wrote beside its graph
from the model dir's stored codes (:mod:`prunus.native.weights`); the graph itself is never parsed for them.
"""

from __future__ import annotations

import numpy as np
import torch

from prunus.native.decoder import NativeDecoder
from prunus.native.weights import PackedModel

from .native_decoder import pack_export  # noqa: F401  (the parity check's API)


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

