"""Decode steps through ``torch.compile``, gpt-fast style: one graph per batch bucket.

A compiled graph wants fixed shapes, and a continuous batch changes size every few
steps. So the batch is padded to a bucket (1, 2, 4, ... up to the slot count; the
padding repeats the first row, whose writes are then the same values to the same
place), and attention reads every row's whole cache line with a mask of its own
length, so the key length is fixed too (a layer's sliding window narrows that mask in
the model, as in the eager path). The prefill stays eager: prompts come in any
length, and one prefill per request is not where the time goes.

On the demo model (3.3M parameters, one thread, a 2-core AVX2 machine) a one-row
decode step took 1.6-2.1 ms compiled (with frozen weights and the C++ wrapper) against
3.8 ms eager; a step of 8 rows, bound by its matmuls, 4.9-5.0 against 5.3 ms.
Compiling costs 10-25 s per bucket at load, which is why it is opt-in
(``Engine.load(..., compile=True)``).
"""

from __future__ import annotations

import torch

from prunus.artifacts.errors import PrunusError


def buckets(n_slots: int) -> list[int]:
    out, b = [], 1
    while b < n_slots:
        out.append(b)
        b *= 2
    return out + [n_slots]


class StaticStep:
    """The ``cache`` a compiled step's model sees: fixed shapes, rows and positions as tensors.

    ``prunus.models.kv_cache.KVCacheProtocol`` over a :class:`prunus.serve.batch_cache.BatchKVCache`'s
    storage. Needs ``update`` (writes at each row's position, returns the rows' whole cache lines) and
    ``attn_mask`` (each row's keys up to its position). ``advance`` does nothing: the lengths move
    outside the graph (:meth:`CompiledDecode.__call__`). ``seq_len`` is None: the step passes positions.
    """

    seq_len = None

    def __init__(self, cache, rows: torch.Tensor, pos: torch.Tensor):
        self.cache, self.rows, self.pos = cache, rows, pos
        keys = torch.arange(cache.max_len, device=pos.device)
        self.mask = (keys[None, :] <= pos).view(pos.shape[0], 1, 1, cache.max_len)

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ck, cv = self.cache.k[layer_id], self.cache.v[layer_id]
        ck[self.rows[:, None], :, self.pos] = k.transpose(1, 2)
        cv[self.rows[:, None], :, self.pos] = v.transpose(1, 2)
        return ck[self.rows], cv[self.rows]

    def attn_mask(self, q_len: int, k_len: int) -> torch.Tensor:
        return self.mask

    def advance(self, n: int) -> None:
        pass


class CompiledDecode:
    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        self.buckets = buckets(cache.n_slots)
        # freezing: the weights become constants, folded and prepacked; cpp_wrapper: the graph's calls from C++
        self._fn = torch.compile(self._step, dynamic=False, fullgraph=True,
                                 options={"freezing": True, "cpp_wrapper": True})

    def _step(self, tokens: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, cache=StaticStep(self.cache, rows, pos), positions=pos)[:, -1]

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def __call__(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        n = len(rows)
        pad = self.bucket(n) - n
        rows_t = torch.tensor(rows + rows[:1] * pad, dtype=torch.long)
        pos = self.cache.lengths[rows_t].view(-1, 1)
        if int(pos.max()) + 1 > self.cache.max_len:
            raise PrunusError(f"KV cache: {int(pos.max()) + 1} tokens exceed its capacity of {self.cache.max_len}; "
                              "shorten the prompt or the output")
        device = self.cache.device
        tok = torch.tensor(tokens + tokens[:1] * pad, dtype=torch.long, device=device).view(-1, 1)
        logits = self._fn(tok, rows_t.to(device), pos.to(device))[:n]
        self.cache.lengths[rows_t[:n]] += 1
        return logits.float().cpu()

    def warm_up(self, set_threads=None) -> None:
        """Compile every bucket now (rows from 0, cache rows used as scratch), not on a request's step."""
        for b in self.buckets:
            if set_threads is not None:
                set_threads(b)
            self.cache.lengths[:b] = 0
            self(list(range(b)), [0] * b)
        self.cache.lengths.zero_()
