"""Ulysses (DeepSpeed-Ulysses) context parallelism: all-to-all from sequence-sharded to head-sharded and back.

Around attention, one all-to-all turns each rank's (batch, heads, local sequence,
head_dim) into (batch, heads/n, whole sequence, head_dim): rank ``j`` receives head
group ``j`` of every rank's chunks. Attention then runs unchanged (the model's own
causal core) on whole sequences, and a second all-to-all returns the output to the
sequence sharding. Two all-to-alls per direction per block; the heads must divide
by the context-parallel degree (after tensor parallelism's split). Keys and values
arrive with their grouped-query (kv) heads only, as the model's core receives them;
they are repeated to all query heads here (``repeat_kv``) before the exchange, so
every head group travels with its own keys and values whatever the kv heads divide.

The attention that runs on whole sequences is the layer's own core (``inner``), so its
sliding window, soft-cap and scale apply unchanged.

The local sequence is the load-balanced pair of chunks ``(r, 2n-1-r)`` that ring
attention needs, so both implementations share one batch layout; the chunks are put
back in order after the exchange (no work imbalance here: every rank attends over
the whole sequence for its heads). The all-to-all is torch's autograd-aware
functional collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from prunus.artifacts.errors import PrunusError
from prunus.models.llama import CausalAttention, repeat_kv


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """all-to-all over dim 0 (one slice per rank), differentiable."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), None, None, group))


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(b, H, s, d), local chunks (r, 2n-1-r) -> (b, H/n, n*s, d), the whole sequence in order."""
    n = dist.get_world_size(group)
    b, heads, s, d = x.shape
    x = x.view(b, n, heads // n, s, d).transpose(0, 1)  # (n, b, h, s, d): head group j goes to rank j
    x = _exchange(x, group).view(n, b, heads // n, 2, s // 2, d)  # [j]: rank j's chunks j and 2n-1-j
    chunks = torch.cat([x[:, :, :, 0], x[:, :, :, 1].flip(0)])  # chunks 0..n-1, then n..2n-1
    return chunks.permute(1, 2, 0, 3, 4).reshape(b, heads // n, n * s, d)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: (b, H/n, n*s, d) -> (b, H, s, d)."""
    n = dist.get_world_size(group)
    b, h, total, d = x.shape
    s = total // n
    x = x.view(b, h, 2 * n, s // 2, d)
    pairs = torch.stack([x[:, :, :n], x[:, :, n:].flip(2)], dim=3)  # (b, h, n, 2, s/2, d): rank j's two chunks
    x = _exchange(pairs.permute(2, 0, 1, 3, 4, 5), group).view(n, b, h, s, d)  # [j]: head group j of my chunks
    # laid out as (b, s, H, d), so the model's transpose and reshape for wo is a view, not a copy
    return x.permute(1, 3, 0, 2, 4).reshape(b, s, n * h, d).transpose(1, 2)


class UlyssesAttention(nn.Module):
    """Drop-in for the model's ``CausalAttention`` core under ``--cp N --cp-impl ulysses``; no parameters."""

    def __init__(self, group, inner: nn.Module | None = None):
        super().__init__()
        self.group = group
        self.inner = inner if inner is not None else CausalAttention()

    def forward(self, q, k, v, mask=None):
        if mask is not None:
            raise PrunusError("Ulysses attention trains on whole sequences: it takes no KV cache or mask")
        n = dist.get_world_size(self.group)
        if n == 1:
            return self.inner(q, k, v)
        k, v = repeat_kv(k, v, q.shape[1])
        if q.shape[1] % n or k.shape[1] % n:
            raise PrunusError(f"Ulysses attention: {q.shape[1]} local heads are not divisible by --cp {n}; "
                              "choose a --cp that divides the heads (per tensor-parallel rank) or --cp-impl ring")
        q, k, v = (seq_to_heads(t, self.group) for t in (q, k, v))
        return heads_to_seq(self.inner(q, k, v), self.group)
