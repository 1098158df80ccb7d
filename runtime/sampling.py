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
    seeded: bool = False  # the request gave its seed: its draws must repeat (speculative decoding keeps its k fixed)


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


def sampling_probs(logits: torch.Tensor, r: RowSampling) -> torch.Tensor:
    """The distribution :func:`prunus.models.sample_next` draws a sampled row's token from, (rows, vocab) float32
    on the logits' device: the same shift, temperature, top-k and top-p (speculative decoding compares these)."""
    from prunus.models.generate import MAX_TEMPERATURE

    logits = logits.float()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / min(float(r.temperature), MAX_TEMPERATURE)
    if r.top_k is not None and 0 < r.top_k < logits.shape[-1]:
        kth = torch.topk(logits, r.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if r.top_p is not None and 0 < r.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= r.top_p
        drop[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(dim=-1)


def is_greedy(r: RowSampling) -> bool:
    """Whether a row picks its argmax (no generator, or a temperature sample_next treats as greedy)."""
    from prunus.models.generate import MIN_TEMPERATURE

    return r.generator is None or not r.temperature > MIN_TEMPERATURE
