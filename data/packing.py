"""Sequence packing: instruction documents laid end to end in fixed-length rows, boundaries kept.

Each document of ``n`` tokens fills ``n - 1`` positions (inputs ``tokens[:-1]``, targets
``tokens[1:]``, a target set to ``IGNORE_INDEX`` where that token is not trained). Documents are placed
in file order, a new row begun when the next one does not fit; the rest of a row is padding (targets
ignored). Every position carries its document's id and its position *within* the document, so the
model (``Transformer(..., positions=, doc_ids=)``) attends only inside a document with positions
restarting at 0: a packed document scores exactly as it would alone. A document longer than the
sequence is cut to it, and the count of cut documents is reported, never silently.

Batches are a pure function of ``(seed, step, rank)`` as for text corpora (:mod:`prunus.data.batches`):
the rows of step ``s`` are positions ``s * B .. s * B + B - 1`` of an endless sequence of epochs, each
epoch a permutation of the rows drawn from ``(seed, epoch)``; a resumed run sees exactly the batches
it would have seen. Each batch also carries the number of trained targets in the whole global batch,
so the loss is the mean over the global batch's trained tokens under any layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from .instruct import Document, load_documents

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index
PAD_DOC = -1  # the document id of padding


@dataclass
class PackedRows:
    """Rows of ``seq_len`` positions: inputs, targets, positions within the document, document ids."""

    tokens: np.ndarray  # int64 (rows, seq_len)
    targets: np.ndarray
    positions: np.ndarray
    doc_ids: np.ndarray
    n_docs: int
    truncated: int  # documents cut to the sequence length

    def __len__(self) -> int:
        """Tokens that are not padding."""
        return int((self.doc_ids != PAD_DOC).sum())

    @property
    def n_rows(self) -> int:
        return self.tokens.shape[0]


def doc_arrays(doc: Document, seq_len: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(inputs, targets, truncated) of one document, cut to ``seq_len`` positions."""
    tokens, trained = doc.tokens, doc.trained
    cut = len(tokens) - 1 > seq_len
    if cut:
        tokens, trained = tokens[:seq_len + 1], trained[:seq_len + 1]
    targets = np.where(trained[1:], tokens[1:], IGNORE_INDEX)
    return tokens[:-1], targets, cut


def pack(docs: list[Document], seq_len: int, pad_id: int = 0) -> PackedRows:
    """Pack ``docs`` in order into rows of ``seq_len`` positions (see the module docstring)."""
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
    used, truncated = 0, 0
    for doc in docs:
        x, y, cut = doc_arrays(doc, seq_len)
        truncated += cut
        if used + len(x) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((x, y))
        used += len(x)
    shape = (len(rows), seq_len)
    tokens, targets = np.full(shape, pad_id, np.int64), np.full(shape, IGNORE_INDEX, np.int64)
    positions, doc_ids = np.zeros(shape, np.int64), np.full(shape, PAD_DOC, np.int64)
    for r, row in enumerate(rows):
        at = 0
        for d, (x, y) in enumerate(row):
            n = len(x)
            tokens[r, at:at + n], targets[r, at:at + n] = x, y
            positions[r, at:at + n], doc_ids[r, at:at + n] = np.arange(n), d
            at += n
        positions[r, at:] = np.arange(seq_len - at)  # padding: one more run, causal among itself
    return PackedRows(tokens, targets, positions, doc_ids, len(docs), truncated)


@dataclass
class PackedCorpus:
    """Packed instruction data: what the trainer reads in place of a text corpus."""

    name: str
    train: PackedRows
    val: PackedRows

    @property
    def truncated(self) -> int:
        return self.train.truncated + self.val.truncated

    def truncation_note(self, seq_len: int) -> str | None:
        """One line when documents were cut to the sequence length, else None."""
        if not self.truncated:
            return None
        total = self.train.n_docs + self.val.n_docs
        return (f"warning: {self.truncated} of {total} rows of {self.name} are longer than --seq-len {seq_len} and "
                "were truncated to it; raise --seq-len or shorten them")


def load_packed(path, tokenizer, *, seq_len: int, vocab_size: int | None = None, train_on_prompt: bool = False,
                val_fraction: float = 0.05) -> PackedCorpus:
    """Read, render and pack an instruction file (:func:`prunus.data.instruct.load_documents`)."""
    train, val = load_documents(path, tokenizer, vocab_size=vocab_size, train_on_prompt=train_on_prompt,
                                val_fraction=val_fraction)
    pad = getattr(tokenizer, "eos_id", None) or 0
    return PackedCorpus(str(path), pack(train, seq_len, pad), pack(val, seq_len, pad))


@lru_cache(maxsize=8)
def _epoch_order(seed: int, epoch: int, n_rows: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


def step_rows(seed: int, step: int, n_global: int, n_rows: int) -> np.ndarray:
    """Row indices of optimizer step ``step``'s global batch (``n_global`` rows)."""
    g = step * n_global + np.arange(n_global)
    epochs = g // n_rows
    return np.array([_epoch_order(seed, int(e), n_rows)[i % n_rows] for e, i in zip(epochs, g)], dtype=np.int64)


def _tensors(rows: PackedRows, idx: np.ndarray) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(np.ascontiguousarray(a[idx])) for a in (rows.tokens, rows.targets, rows.positions, rows.doc_ids))


@dataclass
class PackedBatch:
    """One micro-batch of packed rows: what the model reads (``inputs``, each position's place in its document
    and the document's id) and what the loss needs (``targets``, and ``n_trained``: the trained targets of the
    whole global batch the micro-batch belongs to, which normalises its loss under any layout)."""

    inputs: torch.Tensor  # int64 (rows, seq_len)
    targets: torch.Tensor  # IGNORE_INDEX where a token is not trained
    positions: torch.Tensor  # position within the document, restarting at 0
    doc_ids: torch.Tensor  # PAD_DOC for padding
    n_trained: int

    def model_kwargs(self) -> dict:
        """The model's keyword arguments: attention stays inside a document, positions restart with it."""
        return {"positions": self.positions, "doc_ids": self.doc_ids}


def get_packed_batch(rows: PackedRows, *, seed: int, step: int, micro_batch: int, grad_accum: int = 1, micro: int = 0,
                     rank: int = 0, world: int = 1) -> PackedBatch:
    """One rank's micro-batch of optimizer step ``step``; its ``n_trained`` counts the whole global batch's."""
    idx = step_rows(seed, step, world * grad_accum * micro_batch, rows.n_rows)
    start = (micro * world + rank) * micro_batch
    n_trained = int((rows.targets[idx] != IGNORE_INDEX).sum())
    return PackedBatch(*_tensors(rows, idx[start:start + micro_batch]), n_trained)


def packed_eval_batches(rows: PackedRows, *, batch_size: int, max_tokens: int | None = None):
    """The held-out rows in order, ``batch_size`` at a time, up to ``max_tokens`` positions: the same for every
    run (each batch's ``n_trained`` counts its own trained targets)."""
    n = rows.n_rows if max_tokens is None else min(rows.n_rows, max(1, math.ceil(max_tokens / rows.tokens.shape[1])))
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(start + batch_size, n))
        yield PackedBatch(*_tensors(rows, idx), int((rows.targets[idx] != IGNORE_INDEX).sum()))
