"""The parallel layers every grid shares: linear, embedding, RMSNorm, and the vocabulary-parallel loss.

Each layer holds its shard of the weight as a DTensor parameter on the grid's mesh (so parameter names,
checkpoints and the full weights of the model dir stay those of the unmodified model) and asks its grid
(:class:`~.summa_2d.Summa2D`, :class:`~.tesseract_2p5d.Tesseract2p5D`, :class:`~.cube_3d.Cube3D`) how
to compute with it: which collectives, over which of the mesh's sub-groups. Activations are plain
tensors: this rank's sequences (a ``row`` chunk of the batch) and its slice of the features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from .collectives import _reduce, all_gather, all_reduce_max, all_reduce_shared


def local_shard(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's block of ``full`` under ``placements`` (mesh dims in order, each splitting the block left by the
    ones before it, as DTensor nests shards)."""
    block = full
    for dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            block = block.chunk(mesh.size(dim), dim=placement.dim)[mesh.get_local_rank(dim)]
    return block


def shard_parameter(p: torch.Tensor, mesh, placements) -> nn.Parameter:
    local = local_shard(p.detach(), mesh, placements).clone()
    return nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False), requires_grad=p.requires_grad)


IGNORE_INDEX = -100  # cross-entropy's ignored target (prunus.data.packing's too)


def rows(x: torch.Tensor, index: int, parts: int, fill: int | None = None) -> torch.Tensor:
    """Chunk ``index`` of ``parts`` of the batch (dim 0). A batch that does not split evenly (the last evaluation
    batch) is padded first: with copies of its last row, or with ``fill`` (targets: ignored)."""
    short = -x.shape[0] % parts
    if short:
        pad = x[-1:].expand(short, *x.shape[1:]) if fill is None else x.new_full((short, *x.shape[1:]), fill)
        x = torch.cat([x, pad])
    n = x.shape[0] // parts
    return x[index * n:(index + 1) * n]


class SharedInput:
    """One gather of an input that several linears read (q, k and v; w1 and w3): the gathered tensor is kept
    while the next linear asks for the same input tensor, and autograd sums the consumers' gradients into one
    backward collective. Cleared at the embedding and the loss, so nothing outlives a forward pass."""

    def __init__(self):
        self._last = None  # (input, dim, group, gathered)

    def gather(self, x, dim: int, group, label: str):
        last = self._last
        if last is not None and last[0] is x and last[1] == dim and last[2] is group:
            return last[3]
        out = all_gather(x, dim, group, label)
        self._last = (x, dim, group, out)
        return out

    def clear(self) -> None:
        self._last = None


def _local(p):
    return None if p is None else p.to_local()


class GridLinear(nn.Module):
    """``nn.Linear`` with its weight split over the grid; ``flip``: the input is in the grid's second layout (3D)."""

    def __init__(self, linear: nn.Linear, grid, flip: bool, label: str):
        super().__init__()
        self.grid, self.flip, self.label = grid, flip, label
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = shard_parameter(linear.weight, grid.mesh, grid.weight_placements(flip))
        self.bias = (None if linear.bias is None else
                     shard_parameter(linear.bias, grid.mesh, grid.bias_placements(flip)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.grid.linear(x, self.weight.to_local(), _local(self.bias), self.flip, self.label)


class GridEmbedding(nn.Module):
    """``nn.Embedding`` whose table is split as the output head's weight (so tied embeddings share it)."""

    def __init__(self, emb: nn.Embedding, grid, label: str):
        super().__init__()
        self.grid, self.label = grid, label
        self.num_embeddings, self.embedding_dim = emb.num_embeddings, emb.embedding_dim
        self.weight = shard_parameter(emb.weight, grid.mesh, grid.weight_placements(False))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.grid.embed(tokens, self.weight.to_local(), self.num_embeddings, self.label)


def vocab_lookup(tokens: torch.Tensor, table: torch.Tensor, start: int) -> torch.Tensor:
    """Rows of ``table`` (vocabulary ids ``start..start+len``) for ``tokens``; zeros for ids outside it."""
    local = tokens - start
    outside = (local < 0) | (local >= table.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), table)
    return out * (~outside).unsqueeze(-1).to(out.dtype)


class GridRMSNorm(nn.Module):
    """RMSNorm (or Gemma's (1 + w) norm) over features split across the grid: the sum of squares is all-reduced."""

    def __init__(self, norm: nn.Module, grid, label: str):
        super().__init__()
        self.grid, self.label = grid, label
        self.eps = norm.eps
        self.offset = not isinstance(norm, nn.RMSNorm)  # OffsetRMSNorm: x * (1 + w), in fp32
        self.dim = norm.weight.shape[0]
        self.weight = shard_parameter(norm.weight, grid.mesh, grid.norm_placements())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if self.offset else x
        ss = self.grid.feature_sum(xf.pow(2).sum(-1, keepdim=True), self.label)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        out = xf * torch.rsqrt(ss / self.dim + eps)
        w = self.grid.norm_weight(self.weight.to_local(), self.label)
        return (out * (1.0 + w.float())).type_as(x) if self.offset else out * w


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of logits split over the vocabulary across ``group`` (Megatron's): the max, the
    sum of exponentials and the target's logit are all-reduced; each rank's gradient is its slice of
    softmax - one-hot, no communication."""

    @staticmethod
    def forward(ctx, logits, target, start, group, label):
        m = all_reduce_max(logits.max(-1).values, group, label)
        z = logits - m.unsqueeze(-1)
        exp = z.exp()
        total = _reduce(exp.sum(-1), group, label)
        local = target - start
        inside = (local >= 0) & (local < logits.shape[-1])
        local = local.masked_fill(~inside, 0)
        picked = _reduce(z.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside, group, label)
        kept = (target != IGNORE_INDEX).to(logits.dtype)
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, inside, kept)
        return (total.log() - picked) * kept

    @staticmethod
    def backward(ctx, grad):
        probs, local, inside, kept = ctx.saved_tensors
        g = probs.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        return g * (grad * kept).unsqueeze(-1), None, None, None, None


def vocab_parallel_loss(logits, targets, vocab_group, vocab_start: int, token_groups, n_tokens: int,
                        reduction: str, label: str) -> torch.Tensor:
    """Cross-entropy of this rank's tokens' vocabulary-split logits, summed over the grid's tokens (every rank
    gets the whole batch's value): the mean over ``n_tokens`` (the batch's targets not ignored), or the sum."""
    per_token = _VocabParallelCE.apply(logits.float().flatten(0, -2), targets.flatten(), vocab_start, vocab_group, label)
    total = per_token.sum()
    for group in token_groups:
        total = all_reduce_shared(total, group, label)
    return total / max(n_tokens, 1) if reduction == "mean" else total
