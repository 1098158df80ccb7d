"""Automatic prefix caching: the KV blocks of token prefixes seen before, reused by prompts that start the same way.

A row's keys and values are cut into blocks of ``block`` tokens. Each full block is stored under a hash of the
whole token prefix up to and including it (a chain: block i's key hashes block i-1's key and block i's tokens), so
one key names one exact prefix, never a block that merely holds the same tokens after a different start.
Blocks live on the cache's own device, at most ``budget_mb`` of them; the least recently used go first, and a
prefix's blocks are touched child first so that a parent outlives its children (a child without its parent can
never be reached).

On a new prompt, :meth:`PrefixCache.restore` copies the longest stored block-aligned prefix into the row (at most
the prompt minus its last token: that one must run to give the first logits) and sets the row's length; the
backend then runs only the rest through its ``extend`` path. :meth:`PrefixCache.store` copies a row's full blocks
in after its prompt is prefilled and again when its request leaves (prompt and answer, for the next turn).

The cache it reads and writes is anything with ``k`` and ``v`` (per layer, a (rows, kv heads, positions, head dim)
tensor, by layer id) and ``lengths`` (tokens held per row): the torch backend's
:class:`prunus.runtime.batch_cache.BatchKVCache`, or :class:`ArrayRows` over numpy buffers (the genai backend's, float32
or float16), viewed in place as tensors.

``stats`` is a live dict (the engine's info shows it): lookups, hits, tokens reused, blocks stored and evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

from .load_options import check_budget

BLOCK = 16  # tokens per cached block


class ArrayRows:
    """Numpy KV buffers (one key and one value array per layer, (rows, kv heads, positions, head dim)) and their
    ``lengths`` array, as a :class:`PrefixCache` reads them: tensors sharing the arrays' memory (no copy), so blocks
    restored here are what the buffers' own readers see."""

    def __init__(self, k: list, v: list, lengths):
        self.k = {i: torch.from_numpy(a) for i, a in enumerate(k)}
        self.v = {i: torch.from_numpy(a) for i, a in enumerate(v)}
        self.lengths = lengths


def block_keys(ids: list[int], n_blocks: int, block: int) -> list[bytes]:
    """The chained hash of each of the first ``n_blocks`` blocks of ``ids``."""
    keys, h = [], b""
    for i in range(n_blocks):
        h = hashlib.blake2b(h + array("q", ids[i * block:(i + 1) * block]).tobytes(), digest_size=16).digest()
        keys.append(h)
    return keys


class PrefixCache:
    def __init__(self, cache, budget_mb: float, block: int = BLOCK):
        check_budget(budget_mb)
        self.cache, self.block = cache, block
        self.layers = list(cache.k)
        k0 = cache.k[self.layers[0]]
        self.block_bytes = 2 * len(self.layers) * k0.shape[1] * block * k0.shape[3] * k0.element_size()
        self.capacity = int(budget_mb * 2**20) // self.block_bytes  # blocks that fit the budget
        self.blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # key -> (layers, 2, kv heads, block, head dim)
        self.stats = {"block_tokens": block, "budget_mb": budget_mb, "capacity_blocks": self.capacity,
                      "lookups": 0, "hits": 0, "prompt_tokens": 0, "reused_tokens": 0,
                      "blocks": 0, "stored_blocks": 0, "evicted_blocks": 0}

    def clear(self) -> None:
        """Forget every block (the counts stay)."""
        self.blocks.clear()
        self.stats["blocks"] = 0

    def _touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):  # the parent ends most recent: children are evicted before it
            self.blocks.move_to_end(key)

    def restore(self, row: int, ids: list[int]) -> int:
        """Copy the longest stored prefix of ``ids`` (whole blocks, leaving its last token) into ``row``; the
        tokens the row now holds (0: none stored)."""
        keys = block_keys(ids, (len(ids) - 1) // self.block, self.block)
        hit = 0
        while hit < len(keys) and keys[hit] in self.blocks:
            hit += 1
        self.stats["lookups"] += 1
        self.stats["prompt_tokens"] += len(ids)
        if not hit:
            return 0
        self._touch(keys[:hit])
        stacked = torch.stack([self.blocks[k] for k in keys[:hit]])  # (hit, layers, 2, heads, block, dim)
        n = hit * self.block
        for j, layer in enumerate(self.layers):
            kv = stacked[:, j].permute(1, 2, 0, 3, 4).reshape(2, stacked.shape[3], n, stacked.shape[5])
            self.cache.k[layer][row, :, :n] = kv[0]
            self.cache.v[layer][row, :, :n] = kv[1]
        self.cache.lengths[row] = n
        self.stats["hits"] += 1
        self.stats["reused_tokens"] += n
        return n

    def store(self, row: int, ids: list[int]) -> None:
        """Store the full blocks of ``ids`` the row holds (those not stored yet), evicting the least recently
        used blocks to stay under the budget."""
        held = min(len(ids), int(self.cache.lengths[row]))
        keys = block_keys(ids, min(held // self.block, self.capacity), self.block)
        have = [k for k in keys if k in self.blocks]
        self._touch(have)
        new = [i for i, k in enumerate(keys) if k not in self.blocks]
        if new:
            first, last = new[0] * self.block, (new[-1] + 1) * self.block
            span = torch.stack([torch.stack([self.cache.k[layer][row, :, first:last], self.cache.v[layer][row, :, first:last]])
                                for layer in self.layers])  # (layers, 2, heads, tokens, dim)
            span = span.unflatten(3, (-1, self.block))  # (layers, 2, heads, blocks, block, dim)
            for i in new:
                while len(self.blocks) >= self.capacity:
                    self.blocks.popitem(last=False)
                    self.stats["evicted_blocks"] += 1
                self.blocks[keys[i]] = span[:, :, :, i - new[0]].clone()
                self.stats["stored_blocks"] += 1
            self._touch(keys)
        self.stats["blocks"] = len(self.blocks)
