"""A key/value cache the forward pass takes and fills.

Preallocated per layer as (batch, n_kv_heads, max_len, head_dim). Attention
layers call :meth:`KVCache.update` with their new keys and values and attend to
everything cached so far; the model calls :meth:`advance` once per forward.
Layers are keyed by id, so a model with blocks removed keeps working.
"""

from __future__ import annotations

import torch

from .errors import PrunusError


class KVCache:
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
        last key) is right. A cache holding ragged sequences returns a boolean mask instead."""
        return None

    def advance(self, n: int) -> None:
        self.seq_len += n

    def reset(self) -> None:
        self.seq_len = 0
