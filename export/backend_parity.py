"""A serving runtime as the parity check sees it (:mod:`prunus.export.parity`): the very :class:`Backend` that
serves (:mod:`prunus.runtime.backend`), driven through its own protocol.

``graphs(tokens)`` gives every position's logits of a batch of token rows: each row is prefilled with its first
token (that position's logits) and the rest goes through ``verify_rows`` in one pass, the call speculative
decoding verifies drafts with (the logits after each token). ``graphs.greedy(prompts, n)`` prefills the prompts
and decodes greedily, step by step, through the backend's KV cache; ``follow`` feeds given tokens instead
(teacher forcing through the cache). A backend of the rows and positions a call needs is made
(``make(n_slots, max_len)``) and kept for the next calls that fit in it (their rows start afresh); ``close()``
closes it.

An export's check loads the written dir with the runtime table, as ``prunus serve --no-native`` does
(:func:`export_graphs`: ONNX Runtime over the genai graph or the prefill / decode graphs), and the native kernels'
record of an export or of a model dir is this over :class:`prunus.runtime.native_backend.NativeBackend`: what the
check decodes through is what ``prunus serve`` decodes through.
"""

from __future__ import annotations

from typing import Callable

import torch

from prunus.artifacts.errors import PrunusError


class BackendGraphs:
    """``graphs(tokens)`` -> every position's logits and ``graphs.greedy(prompts, n)`` through backends that
    ``make(n_slots, max_len)`` builds; each must verify rows (``capabilities.verify_rows``)."""

    def __init__(self, make: Callable[[int, int], object]):
        self.make, self.held = make, None

    def _backend(self, n_slots: int, max_len: int):
        held = self.held
        if held is not None and held.n_slots >= n_slots and held.max_len >= max_len:
            for row in range(held.n_slots):
                held.release(row)
            return held
        if held is not None:
            n_slots, max_len = max(n_slots, held.n_slots), max(max_len, held.max_len)
            self.close()
        backend = self.make(n_slots, max_len)
        if not backend.capabilities.verify_rows:
            backend.close()
            raise PrunusError(f"the {getattr(backend, 'name', 'runtime')} backend cannot verify rows: no parity "
                              "check through it")
        self.held = backend
        return backend

    def close(self) -> None:
        if self.held is not None:
            self.held.close()
            self.held = None

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab), like the PyTorch model without a cache."""
        b, s = tokens.shape
        rows = list(range(b))
        backend = self._backend(b, s)
        first = backend.prefill(rows, [[int(t)] for t in tokens[:, 0]]).float()
        if s == 1:
            return first[:, None]
        rest = backend.verify_rows(rows, [row.tolist() for row in tokens[:, 1:]])
        return torch.stack([torch.cat([first[i:i + 1], rest[i].float()]) for i in rows])

    @torch.inference_mode()
    def greedy(self, prompt: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
               follow: torch.Tensor | None = None) -> torch.Tensor:
        """(batch, prompt_len) prompts -> (batch, max_new_tokens) greedy tokens through the backend's KV cache.
        ``attention_mask`` (1 = real token) trims padding off each prompt; ``follow`` (batch, max_new_tokens): feed
        these tokens instead of the argmaxes; the argmax of every step is still returned."""
        b, s = prompt.shape
        rows = list(range(b))
        prompts = [p.tolist() if attention_mask is None else p[attention_mask[i].bool()].tolist()
                   for i, p in enumerate(prompt)]
        backend = self._backend(b, s + max_new_tokens)
        logits, out = backend.prefill(rows, prompts), []
        for i in range(max_new_tokens):
            token = logits.float().argmax(-1)
            out.append(token.long().cpu())
            if i + 1 < max_new_tokens:
                fed = follow[:, i] if follow is not None else token
                logits = backend.decode(rows, [int(t) for t in fed])
        return torch.stack(out, dim=1)


def native_graphs(packed, threads: int | None = None) -> BackendGraphs:
    """The native runtime that serves (:class:`prunus.runtime.native_backend.NativeBackend`) over ``packed`` weights
    (an export's ``native_weights.safetensors`` or a model dir's, packed at load), as the parity check drives it."""
    from prunus.runtime.native_backend import NativeBackend

    return BackendGraphs(lambda n_slots, max_len: NativeBackend(packed, n_slots, max_len, threads))


def served_backend(export_dir, config: dict, n_slots: int, max_len: int | None = None, threads: int | None = None):
    """The backend ``prunus serve --no-native`` serves the written export dir (its ``config.json``) with: the runtime
    table's ONNX Runtime row for it, loaded."""
    from pathlib import Path

    from prunus.runtime.load_options import LoadOptions
    from prunus.runtime.registry import find_runtime

    options = LoadOptions(max_batch=n_slots, max_len=max_len, threads=threads, native=False)
    return find_runtime("onnxruntime", config, options).load(Path(export_dir), config, options).backend


def export_graphs(export_dir, config: dict, threads: int | None = None) -> BackendGraphs:
    """The written export dir as ``prunus serve --no-native`` serves it (:func:`served_backend`), as the parity
    check drives it."""
    return BackendGraphs(lambda n_slots, max_len: served_backend(export_dir, config, n_slots, max_len, threads))
