"""Mixture of experts: a routed SwiGLU layer that replaces a block's feed-forward when ``n_experts > 0``.

Each token's router scores (linear, softmax in fp32) pick its ``top_k`` experts;
their weights are renormalised to sum to one (unless ``moe_norm_topk`` is off, as in
Qwen3-MoE checkpoints with ``norm_topk_prob: false``). Tokens are grouped by expert,
each expert (SwiGLU, weights stored batched: ``w1``/``w3`` (n_experts, dim,
hidden), ``w2`` (n_experts, hidden, dim), so they split over experts along dim
0) runs on its group, and the outputs are summed back per token, weighted.
``n_shared_experts`` experts (one SwiGLU of ``n_shared * hidden``) see every
token.

Groups are sequences (GShard's "groups"): in training, each expert takes at
most ``capacity = ceil(capacity_factor * seq_len * top_k / n_experts)`` tokens
of one sequence; a sequence's first choices are served before its second ones,
in token order, and the rest are dropped (they pass through the residual).
The load-balancing loss (Switch Transformer, eq. 4, with top_k choices):

    aux = coef * n_experts * sum_i f_i * P_i,

f_i the fraction of the sequence's routed choices that picked expert i (before
dropping), P_i the mean router probability of expert i over the sequence; the
layer's loss is the mean over sequences. Grouping by sequence makes both
layout-independent: a batch split over data-parallel ranks or micro-steps drops
the same tokens and has the same loss as in one process. In eval mode nothing
is dropped, so evaluation and generation with a KV cache agree.

After each forward the layer keeps ``aux_loss`` (a scalar tensor in the graph,
training only) and ``dropped`` (routed choices dropped); :func:`moe_aux_loss`
and :func:`moe_dropped` sum them over a model. No parallelism code: expert
parallelism (``prunus.train_parallel.experts.expert_parallel``) replaces how
``GroupedExperts`` runs its token groups, not this module.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .feed_forward import FeedForward


def grouped_swiglu(x: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """x: (tokens, dim) sorted by expert, ``counts[e]`` rows for expert e -> (tokens, dim)."""
    outs = []
    for e, rows in enumerate(torch.split(x, counts)):
        if rows.shape[0] == 0:
            continue
        a, b, c = w1[e].to(rows.dtype), w3[e].to(rows.dtype), w2[e].to(rows.dtype)
        outs.append((F.silu(rows @ a) * (rows @ b)) @ c)
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts with batched weights."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (tokens, dim) sorted by expert; counts: (n_experts,) int64 tokens per expert."""
        return grouped_swiglu(x, counts.tolist(), self.w1, self.w2, self.w3)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk = cfg.n_experts, cfg.top_k, cfg.moe_norm_topk
        self.capacity_factor, self.aux_coef = cfg.capacity_factor, cfg.moe_aux_loss_coef
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.moe_ffn_dim)
        self.shared = FeedForward(cfg.dim, cfg.n_shared_experts * cfg.moe_ffn_dim) if cfg.n_shared_experts else None
        self.aux_loss: torch.Tensor | None = None
        self.dropped = 0

    def capacity(self, seq_len: int) -> int | None:
        """Tokens one expert takes from one sequence; None: unlimited."""
        if not self.training or not self.capacity_factor or self.capacity_factor <= 0:
            return None
        return math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (batch, seq, dim) -> probs (batch, seq, E) fp32, top-k weights and expert ids (batch, seq, k)."""
        probs = self.router(x).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, experts

    def balance_loss(self, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Switch / GShard load-balancing loss per sequence, averaged over the batch (module docstring)."""
        bsz, seqlen, n = probs.shape
        picks = F.one_hot(experts, n).sum(dim=(1, 2)).float()  # (batch, E)
        f = picks / (seqlen * self.top_k)
        p = probs.mean(dim=1)
        return self.aux_coef * n * (f * p).sum(dim=-1).mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        probs, weights, experts = self.route(x)
        # choices in priority order within each sequence: every token's first choice, then its second, ...
        order_e = experts.transpose(1, 2).reshape(bsz, self.top_k * seqlen)  # (batch, k*seq)
        order_w = weights.transpose(1, 2).reshape(bsz, self.top_k * seqlen)
        token = torch.arange(seqlen, device=x.device).repeat(self.top_k) + seqlen * torch.arange(bsz, device=x.device)[:, None]
        keep = torch.ones_like(order_e, dtype=torch.bool)
        cap = self.capacity(seqlen)
        if cap is not None:
            slot = F.one_hot(order_e, self.n_experts).cumsum(dim=1).gather(2, order_e[..., None]).squeeze(-1)
            keep = slot <= cap
        self.dropped = int((~keep).sum())
        expert_ids, token_ids, w = order_e[keep], token[keep], order_w[keep]
        # group by expert (stable: within an expert, the priority order above)
        perm = torch.argsort(expert_ids, stable=True)
        token_ids, w = token_ids[perm], w[perm]
        counts = torch.bincount(expert_ids, minlength=self.n_experts)
        flat = x.reshape(-1, dim)
        y = self.experts(flat[token_ids], counts)
        out = torch.zeros_like(flat).index_add_(0, token_ids, (y.float() * w[:, None]).to(flat.dtype))
        out = out.view(bsz, seqlen, dim)
        if self.shared is not None:
            out = out + self.shared(x)
        self.aux_loss = self.balance_loss(probs, experts) if self.training else None
        return out


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the load-balancing losses of the model's MoE layers from the last training forward (None: none)."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def moe_dropped(model: nn.Module) -> int:
    """Routed choices dropped for capacity in the last forward, summed over the model's MoE layers."""
    return sum(m.dropped for m in moe_layers(model))
