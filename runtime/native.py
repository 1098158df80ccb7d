"""The native runtime (:mod:`prunus.runtime.native_backend`) driven as a :class:`prunus.runtime.genai_session
.GenaiSession` is (:class:`NativeSession`), over a genai export's native weights (:func:`pack_export`): the two
runtimes compared call for call on the same export, as the tests and the decode benchmarks do. What serves is
:mod:`prunus.runtime.native_backend`; the parity check drives it through its own protocol
(:mod:`prunus.export.backend_parity`).

The weights are the export's own numbers, read from the ``native_weights.safetensors`` it wrote beside its graph
from the model dir's stored codes (:mod:`prunus.native.weights`); the graph itself is never parsed for them.
"""

from __future__ import annotations

import numpy as np

from prunus.native.weights import PackedModel

from .native_decoder import pack_export


class NativeSession:
    """A genai export's native weights in the native runtime (:class:`prunus.runtime.native_backend.NativeBackend`),
    driven as a :class:`prunus.runtime.genai_session.GenaiSession` is, with the same arguments:
    ``prefill(start, prompts)`` into slots ``[start, start + b)`` and ``decode(lengths, tokens)`` of slots ``[0, b)``
    at the caller's lengths, each returning a view of the logits valid until the next pass; ``k`` / ``v`` are its KV
    buffers. ``config`` and ``spinning`` are ONNX Runtime's session options, which a native session has none of."""

    def __init__(self, graph, n_layers: int, n_kv_heads: int, head_dim: int, vocab_size: int, n_slots: int,
                 max_len: int, threads: int | None = None, config: dict | None = None, packed: PackedModel | None = None,
                 spinning: bool = True):
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
