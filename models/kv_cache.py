"""The KV-cache contract the model reads (:class:`KVCacheProtocol`) and the model's own cache (:class:`KVCache`).

One contract, several caches: the model's attention only ever calls ``update`` and
``attn_mask``, and its forward pass reads ``seq_len`` (when it is given no positions) and
calls ``advance``. The implementations, each saying in its docstring which parts it needs:

* :class:`KVCache` (here): one length for every row, as ``generate`` and gpt-fast's cache;
* ``prunus.runtime.batch_cache.CacheStep``: one pass over the serving slots, rows of different lengths;
* ``prunus.export.graphs.GraphCache``: the export graphs' past keys/values in, present out;
* ``prunus.runtime.compiled_decode.StaticStep``: a compiled decode step with fixed shapes.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from prunus.artifacts.errors import PrunusError


@runtime_checkable
class KVCacheProtocol(Protocol):
    """What :class:`prunus.models.Transformer` reads from the ``cache`` it is given, and nothing more.

    * ``update(layer_id, k, v)``: store one layer's new keys and values (batch, kv_heads, q_len,
      head_dim) and return every key and value the new queries attend to, (batch, kv_heads, k_len,
      head_dim), each row's keys in position order.
    * ``attn_mask(q_len, k_len)``: None where the model's default layout is exact (every row the
      same length: the last query at the last key, causal), else a boolean mask broadcastable to
      (batch, heads, q_len, k_len), True where a query sees a key; every query sees its own key.
      Sliding windows need nothing more: the model narrows this mask to each layer's window
      (``prunus.models.llama.visible_keys``), for any cache that keeps every key of a row.
    * ``advance(n)``: called once per forward pass, after every layer, with the number of new tokens.
    * ``seq_len``: the position of the first new token, read only by a forward pass given no
      ``positions``; None for a cache whose rows may differ, whose caller always passes positions.
    """

    seq_len: int | None

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attn_mask(self, q_len: int, k_len: int) -> torch.Tensor | None: ...

    def advance(self, n: int) -> None: ...


class KVCache:
    """Preallocated per layer as (batch, n_kv_heads, max_len, head_dim), every row the same length.

    Implements the whole :class:`KVCacheProtocol`: ``update`` writes at ``seq_len`` and returns
    everything cached so far, ``attn_mask`` is None (rows of one length), ``advance`` moves
    ``seq_len``, so the forward pass needs no positions. Layers are keyed by id, so a model with
    blocks removed keeps working.
    """

    def __init__(self, layer_ids, batch_size: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype=torch.float32, device=None):
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.max_len = max_len
        self.k = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.v = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.seq_len = 0

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int | None = None, n_kv_heads: int | None = None) -> "KVCache":
        cfg = model.config
        param = next(model.parameters())
        return cls(
            model.layers.keys(), batch_size, n_kv_heads or cfg.n_kv_heads, cfg.head_dim,
            max_len or cfg.max_seq_len, dtype=param.dtype, device=param.device,
        )

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.seq_len, self.seq_len + k.shape[2]
        if end > self.max_len:
            raise PrunusError(f"KV cache: {end} tokens exceed its capacity of {self.max_len}; shorten the prompt or the output")
        ck, cv = self.k[layer_id], self.v[layer_id]
        ck[:, :, start:end] = k
        cv[:, :, start:end] = v
        return ck[:, :, :end], cv[:, :, :end]

    def attn_mask(self, q_len: int, k_len: int) -> torch.Tensor | None:
        """Every sequence has the same length, so the default causal mask (last query at the
        last key) is right."""
        return None

    def advance(self, n: int) -> None:
        self.seq_len += n

    def reset(self) -> None:
        self.seq_len = 0
