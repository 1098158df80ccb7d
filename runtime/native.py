"""The native kernels as a parity check runs them (:mod:`prunus.export.genai_parity`): every position's logits of a
batch of tokens through a scratch cache (:func:`every_position_logits`), and greedy generation through a
:class:`NativeSession` (the native runtime driven as a genai session is), over a genai export's native weights
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



class NativeSession:
    """A genai export's native weights in the native runtime (:class:`prunus.runtime.native_backend.NativeBackend`),
    driven as a :class:`prunus.runtime.genai_session.GenaiSession` is (what ``GenaiSession(..., native=True)`` gives):
    ``prefill(start, prompts)`` into slots ``[start, start + b)`` and ``decode(lengths, tokens)`` of slots ``[0, b)``
    at the caller's lengths, each returning a view of the logits valid until the next pass; ``k`` / ``v`` are its KV
    buffers. The parity check's greedy generation runs it (:mod:`prunus.export.genai_parity`). ``config`` is ONNX
    Runtime's session options, which a native session has none of."""

    def __init__(self, graph, n_layers: int, n_kv_heads: int, head_dim: int, vocab_size: int, n_slots: int,
                 max_len: int, threads: int | None = None, config: dict | None = None, packed: PackedModel | None = None):
        from .native_backend import NativeBackend

        dims = {"n_layers": n_layers, "n_kv_heads": n_kv_heads, "head_dim": head_dim, "vocab_size": vocab_size}
        self.backend = NativeBackend(packed if packed is not None else pack_export(graph, dims), n_slots, max_len,
                                     threads)
        self.k, self.v, self.decoder = self.backend.k, self.backend.v, self.backend.decoder
        self.n_slots, self.max_len, self.vocab_size = n_slots, max_len, vocab_size

    def prefill(self, start: int, prompts: list) -> np.ndarray:
        rows = list(range(start, start + len(prompts)))
        self.backend.held.update(rows)
        return self.backend.run(rows, prompts, np.zeros(len(rows), np.int64))

    def decode(self, lengths: np.ndarray, tokens) -> np.ndarray:
        rows = list(range(len(lengths)))
        self.backend.held.update(rows)
        return self.backend.run(rows, [[int(t)] for t in tokens], np.asarray(lengths, np.int64))

    def close(self) -> None:
        self.backend.close()
