"""Batches as a pure function of (seed, step, rank): a resumed run sees exactly the batches it would have seen.

One optimizer step consumes a global batch of ``world * grad_accum * micro_batch``
windows of ``seq_len + 1`` tokens at offsets drawn from ``(seed, step)``; rank
``r``'s micro-batch ``m`` is one slice of it. The global batch is the same for
every layout, so layouts can be compared loss for loss.
"""

from __future__ import annotations

import numpy as np
import torch


def step_offsets(seed: int, step: int, n_windows: int, seq_len: int, n_tokens: int) -> np.ndarray:
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_tokens - seq_len, size=n_windows)


def windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = offsets[:, None] + np.arange(seq_len + 1)
    arr = torch.from_numpy(np.asarray(tokens[idx]).astype(np.int64))
    return arr[:, :-1], arr[:, 1:]


def get_batch(tokens: np.ndarray, *, seed: int, step: int, micro_batch: int, seq_len: int,
              grad_accum: int = 1, micro: int = 0, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (micro_batch, seq_len) for one rank's micro-step of one optimizer step."""
    offsets = step_offsets(seed, step, world * grad_accum * micro_batch, seq_len, len(tokens))
    start = (micro * world + rank) * micro_batch
    return windows(tokens, offsets[start : start + micro_batch], seq_len)


def eval_batches(tokens: np.ndarray, *, seq_len: int, batch_size: int, max_tokens: int | None = None):
    """Consecutive non-overlapping windows from the start of ``tokens``: the same for every run."""
    n_windows = (len(tokens) - 1) // seq_len
    if max_tokens is not None:
        n_windows = min(n_windows, max(1, max_tokens // seq_len))
    for start in range(0, n_windows, batch_size):
        offsets = np.arange(start, min(start + batch_size, n_windows)) * seq_len
        yield windows(tokens, offsets, seq_len)
