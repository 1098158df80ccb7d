"""Next tokens from a batch of logits where the logits are: only token ids leave the backend's device.

Greedy rows (the common case) take one argmax over the batch on the logits' device. A sampled row
(temperature > 0) draws with its request's own generator on that generator's device (a CPU generator, so a
seed gives the same tokens on every backend): that one row's logits move there, never the whole batch.
The arithmetic is :func:`prunus.models.generate.sample_next`'s (temperature, top-k, top-p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prunus.models import sample_next


@dataclass(frozen=True)
class RowSampling:
    """One row's settings: temperature 0 (or no generator) is greedy."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None


def sample(logits: torch.Tensor, rows: list[RowSampling]) -> list[int]:
    """logits (batch, vocab) on any device, one :class:`RowSampling` per row -> the next token id of each row."""
    if all(r.generator is None for r in rows):
        return sample_next(logits).tolist()
    tokens = []
    for i, r in enumerate(rows):
        row = logits[i:i + 1]
        if r.generator is not None and row.device != r.generator.device:
            row = row.to(r.generator.device)
        tokens.append(int(sample_next(row, r.temperature, r.top_k, r.top_p, r.generator)[0]))  # temperature 0: greedy
    return tokens
