"""Serving an export dir's prefill and decode graphs, with continuous batching.

The graphs (see the export dir contract in ``prunus.export.graphs``) take the past
keys/values as inputs and return them with the new ones appended, masked by
``attention_mask`` (1 = real token) and causal within the new tokens. This backend
keeps its own preallocated cache of ``n_slots`` rows × ``max_len`` positions, each
row its own length, and per pass:

* prefill: the prompts right-padded into one (batch, width) pass, ``position_ids``
  from 0, padding masked out; each row's real keys/values are copied into its slot;
* decode: the rows' pasts gathered to the longest one (batch, heads, k_max, head_dim),
  each right-aligned (a shorter row's past is left-padded, the padding masked out), so
  every row's keys stay contiguous up to its new token, as a sliding window counts them;
  each row's own position in ``position_ids``; the one new key/value per row (at index
  k_max of ``present``) is copied to the row's own next position.

So the ONNX Runtime and TensorRT backends batch exactly like the torch one. ``verify_rows`` (``verifies=True``:
the ONNX Runtime runner, whose decode graph takes any number of new tokens) runs each row's tokens after its past
in one decode pass of its own and returns the logits after each. A runner
does the graph calls: ``run(graph, feeds, outputs) -> list of torch tensors``.

The slots are the torch backend's storage, a :class:`prunus.runtime.batch_cache.BatchKVCache`
(keys, values, each row's length); the model never sees it here, so none of the
``KVCacheProtocol`` is needed: the graphs hold their own (``prunus.export.graphs.GraphCache``).
"""

from __future__ import annotations

import torch

from .backend import BackendBase, Capabilities
from .batch_cache import BatchKVCache


class GraphBackend(BackendBase):
    def __init__(self, runner, *, n_layers: int, n_kv_heads: int, head_dim: int, vocab_size: int, n_slots: int,
                 max_len: int, dtype=torch.float32, device="cpu", name: str = "onnxruntime", verifies: bool = False):
        self.runner, self.name, self.verifies = runner, name, verifies
        self.n_layers, self.n_slots, self.max_len, self.vocab_size = n_layers, n_slots, max_len, vocab_size
        self.device = torch.device(device)
        self.cache = BatchKVCache(range(n_layers), n_slots, n_kv_heads, head_dim, max_len, dtype=dtype, device=device)
        self.k, self.v, self.lengths = self.cache.k, self.cache.v, self.cache.lengths
        self.outputs = ["logits"] + [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(max_batch=self.n_slots, verify=self.verifies, verify_rows=self.verifies)

    def release(self, row: int) -> None:
        self.lengths[row] = 0

    def _long(self, x) -> torch.Tensor:
        return torch.as_tensor(x, dtype=torch.long).to(self.device)

    def prefill(self, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
            mask[i, :len(p)] = 1
        positions = torch.arange(width).expand(len(prompts), width)
        feeds = {"input_ids": self._long(ids), "position_ids": self._long(positions), "attention_mask": self._long(mask)}
        logits, *present = self.runner.run("prefill", feeds, self.outputs)
        for i in range(self.n_layers):
            pk, pv = present[2 * i], present[2 * i + 1]
            for b, (slot, n) in enumerate(zip(rows, lengths)):
                self.k[i][slot, :, :n] = pk[b, :, :n]
                self.v[i][slot, :, :n] = pv[b, :, :n]
        self.lengths[rows] = torch.tensor(lengths)
        last = torch.tensor(lengths) - 1
        return logits[torch.arange(len(prompts)), last.to(logits.device)].float().cpu()

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        rows_t = torch.tensor(rows, dtype=torch.long)
        lens = self.lengths[rows_t]
        k_max = int(lens.max())
        src = torch.arange(k_max)[None, :] - (k_max - lens)[:, None]  # (batch, k_max): cache index of each past key
        mask = torch.cat([(src >= 0).long(), torch.ones(len(rows), 1, dtype=torch.long)], 1)
        feeds = {"input_ids": self._long(tokens)[:, None], "position_ids": self._long(lens)[:, None],
                 "attention_mask": self._long(mask)}
        idx = rows_t.to(self.device)
        src = src.clamp(min=0).to(self.device)
        for i in range(self.n_layers):
            # advanced indices (batch, 1) and (batch, k_max) around a slice: (batch, k_max, heads, head_dim)
            feeds[f"past.{i}.key"] = self.k[i][idx[:, None], :, src].transpose(1, 2).contiguous()
            feeds[f"past.{i}.value"] = self.v[i][idx[:, None], :, src].transpose(1, 2).contiguous()
        logits, *present = self.runner.run("decode", feeds, self.outputs)
        pos = lens.to(self.device)
        for i in range(self.n_layers):
            # advanced indices (batch,) and (batch,) around a slice: (batch, heads, head_dim)
            self.k[i][idx, :, pos] = present[2 * i][:, :, k_max].to(self.k[i].dtype)
            self.v[i][idx, :, pos] = present[2 * i + 1][:, :, k_max].to(self.v[i].dtype)
        self.lengths[rows_t] += 1
        return logits[:, -1].float().cpu()

    def verify_rows(self, rows: list[int], token_lists: list[list[int]]) -> list[torch.Tensor]:
        """Each row's tokens after what it holds, a decode pass per row; the logits after each, (len_i, vocab)."""
        out = []
        for row, tokens in zip(rows, token_lists):
            n, k = int(self.lengths[row]), len(tokens)
            feeds = {"input_ids": self._long([tokens]), "position_ids": self._long([list(range(n, n + k))]),
                     "attention_mask": self._long([[1] * (n + k)])}
            for i in range(self.n_layers):
                feeds[f"past.{i}.key"] = self.k[i][row:row + 1, :, :n].contiguous()
                feeds[f"past.{i}.value"] = self.v[i][row:row + 1, :, :n].contiguous()
            logits, *present = self.runner.run("decode", feeds, self.outputs)
            for i in range(self.n_layers):
                self.k[i][row, :, n:n + k] = present[2 * i][0, :, n:n + k].to(self.k[i].dtype)
                self.v[i][row, :, n:n + k] = present[2 * i + 1][0, :, n:n + k].to(self.v[i].dtype)
            self.lengths[row] = n + k
            out.append(logits[0].float().cpu())
        return out

    def verify(self, row: int, tokens: list[int]) -> torch.Tensor:
        return self.verify_rows([row], [tokens])[0]

    def truncate(self, row: int, length: int) -> None:
        self.lengths[row] = length

    def close(self) -> None:
        self.runner.close()
