"""A preallocated KV cache of ``n_slots`` rows × ``max_len`` positions, each row its own length.

Rows are the serving slots: a request takes a free row, its prompt is written at
positions 0..P-1 (prefill), then one position per decode step. Requests join and
leave at any step, so the rows of one forward pass hold sequences of different
lengths. :meth:`BatchKVCache.step` returns the object the model's forward pass
takes as ``cache``: it writes each row's new keys at that row's own positions and
returns a boolean mask (batch, 1, q_len, k_len) in which query i of row b sees keys
``0 .. start[b] + i``. Positions past a row's length may hold stale keys from a
padded prefill or an earlier request; the mask never lets a query see them, and the
next write overwrites them.

Sliding windows (Mistral, Gemma 2's local layers) need nothing here: a row's keys are
contiguous from position 0, so the model narrows this mask to the keys fewer than
``window`` positions before each query's own (``prunus.models.llama.visible_keys``).
"""

from __future__ import annotations

import torch

from prunus.artifacts.errors import PrunusError


class BatchKVCache:
    def __init__(self, layer_ids, n_slots: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype=torch.float32, device=None):
        shape = (n_slots, n_kv_heads, max_len, head_dim)
        self.n_slots, self.max_len = n_slots, max_len
        self.k = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.v = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.lengths = torch.zeros(n_slots, dtype=torch.long)  # tokens held per row (on the CPU)
        self.device = device

    @classmethod
    def for_model(cls, model, n_slots: int, max_len: int | None = None) -> "BatchKVCache":
        """Sized from the model's own tensors: under tensor parallelism wk holds this rank's kv heads."""
        cfg = model.config
        some_layer = next(iter(model.layers.values()))
        wk = some_layer.attention.wk
        n_kv_heads = wk.out_features // cfg.head_dim
        param = model.tok_embeddings.weight
        return cls(model.layers.keys(), n_slots, n_kv_heads, cfg.head_dim, max_len or cfg.max_seq_len,
                   dtype=param.dtype, device=param.device)

    def step(self, rows: list[int], new_lengths: list[int] | None = None, q_len: int = 1,
             n_new: list[int] | None = None) -> "CacheStep":
        """The cache for one forward pass over ``rows`` with ``q_len`` new tokens per row.

        ``new_lengths`` (prefill) starts each row afresh: the row's length becomes its
        prompt length (the rest of the padded ``q_len`` is never seen). Without it every
        row appends after what it holds: ``q_len`` tokens, or ``n_new[i]`` of the padded
        ``q_len`` (a chunk of a prompt whose earlier chunks are cached).
        """
        rows_t = torch.tensor(rows, dtype=torch.long)
        start = torch.zeros(len(rows), dtype=torch.long) if new_lengths is not None else self.lengths[rows_t].clone()
        if int(start.max()) + q_len > self.max_len:
            raise PrunusError(f"KV cache: {int(start.max()) + q_len} tokens exceed its capacity of {self.max_len}; "
                              "shorten the prompt or the output")
        if new_lengths is not None:
            end = torch.tensor(new_lengths, dtype=torch.long)
        else:
            end = start + (torch.tensor(n_new, dtype=torch.long) if n_new is not None else q_len)
        return CacheStep(self, rows_t, start, q_len, end)

    def truncate(self, row: int, length: int) -> None:
        """Keep the row's first ``length`` tokens (speculative decoding rolls back rejected draft tokens): the
        positions past it are never seen again and the next write overwrites them."""
        if not 0 <= length <= int(self.lengths[row]):
            raise ValueError(f"row {row} holds {int(self.lengths[row])} tokens; cannot truncate it to {length}")
        self.lengths[row] = length


class CacheStep:
    """What ``Transformer.forward(tokens, cache=..., positions=step.positions)`` sees for one pass.

    Implements the whole ``prunus.models.kv_cache.KVCacheProtocol``: ``update`` writes each row's
    new keys at the row's own positions, ``attn_mask`` is the ragged rows' mask (None when every
    row has one length), ``advance`` sets the rows' lengths. ``seq_len`` is None: rows start at
    different positions, so the caller passes :attr:`positions`.
    """

    seq_len = None

    def __init__(self, cache: BatchKVCache, rows: torch.Tensor, start: torch.Tensor, q_len: int, end: torch.Tensor):
        self.cache, self.q_len, self.end = cache, q_len, end
        device = cache.device
        self.rows_cpu, self.start_cpu = rows, start
        n = len(rows)
        # one contiguous run of rows is a view of the cache; any other set is gathered
        first = int(rows[0])
        self.contiguous = bool(torch.equal(rows, torch.arange(first, first + n)))
        self.row_slice = slice(first, first + n)
        self.rows = rows.to(device)
        self.start = start.to(device)
        self.k_len = int(start.max()) + q_len
        offs = torch.arange(q_len, device=device)
        self.positions = self.start[:, None] + offs[None, :]  # (batch, q_len)
        # rows of one length need no mask: the model's default (last query at the last key) is exact
        self.uniform = bool((start == start[0]).all())
        self.mask = None
        if not self.uniform:
            keys = torch.arange(self.k_len, device=device)
            self.mask = (keys[None, None, :] <= self.positions[:, :, None]).unsqueeze(1)  # (batch, 1, q_len, k_len)

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ck, cv = self.cache.k[layer_id], self.cache.v[layer_id]
        rows, positions = self.rows, self.positions
        if ck.device != rows.device:  # a device map: this block's cache lives on its block's device
            rows, positions = rows.to(ck.device), positions.to(ck.device)
        if self.contiguous and self.uniform:  # one block of the cache: a plain slice write
            s = int(self.start_cpu[0])
            ck[self.row_slice, :, s:s + self.q_len] = k
            cv[self.row_slice, :, s:s + self.q_len] = v
        else:
            # advanced indices (batch, 1) and (batch, q_len) around a slice: the indexed dims come first
            ck[rows[:, None], :, positions] = k.transpose(1, 2)
            cv[rows[:, None], :, positions] = v.transpose(1, 2)
        if self.contiguous:
            return ck[self.row_slice, :, :self.k_len], cv[self.row_slice, :, :self.k_len]
        return ck[rows, :, :self.k_len], cv[rows, :, :self.k_len]

    def attn_mask(self, q_len: int, k_len: int) -> torch.Tensor | None:
        return self.mask

    def advance(self, n: int) -> None:
        self.cache.lengths[self.rows_cpu] = self.end
