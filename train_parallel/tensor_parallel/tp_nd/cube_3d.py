"""3D tensor parallelism: a ``q x q x q`` cube of ranks ``(p, q', r)`` (Agarwal et al.; Colossal-AI's 3D).

Two activation layouts alternate. In ``L0`` (the residual stream, the norms, the inputs of q/k/v, w1/w3
and the head) rank ``(p, q', r)`` holds batch chunk ``r * q + q'`` of ``q^2`` and feature slice ``p``;
in ``L1`` (the outputs of those layers: attention, the gated hidden, the logits) chunk ``r * q + p`` and
feature slice ``q'``. A linear from ``L0`` keeps weight block ``(out block q', in block p)``, split
once more over ``r`` (1/q^3 of the weight on each rank):

    x = all_gather_q'(x)   (the sequences of chunk r, features p)
    W = all_gather_r(W)    (out block q', in block p)
    y = reduce_scatter_p(x W^T)   (the partial sums over p added; chunk r*q + p, features q')

so inputs, weights and outputs each travel over a different face of the cube. A linear from ``L1``
(wo, w2) swaps the roles of ``p`` and ``q'`` and returns to ``L0``. The embedding is split as the head's
weight (tied embeddings share it): gathered over ``r``, looked up for chunk ``r`` in vocabulary block
``q'``, reduce-scattered over ``q'`` into ``L0``. The loss is vocabulary-parallel over ``q'`` and summed
over ``p`` and ``r``.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from .collectives import all_gather, all_reduce, copy_to, reduce_scatter
from .layers import IGNORE_INDEX, SharedInput, rows, vocab_lookup, vocab_parallel_loss


class Cube3D:
    """The cube on a mesh with dims ``tp_x, tp_y, tp_z`` (``p, q', r``)."""

    mode = "3d"

    def __init__(self, mesh):
        self.mesh = mesh
        self.q = mesh.size(0)
        self.p, self.qq, self.r = (mesh.get_local_rank(n) for n in ("tp_x", "tp_y", "tp_z"))
        self.gp, self.gq, self.gr = (mesh.get_group(n) for n in ("tp_x", "tp_y", "tp_z"))
        self.inputs = SharedInput()

    def _roles(self, flip: bool):
        """(the input's feature group, the group its sequences are gathered over) of a linear from L0 / L1."""
        return (self.gq, self.gp) if flip else (self.gp, self.gq)

    def weight_placements(self, flip: bool = False):
        # dim 0 (out) split by the output's feature dim, then by r; dim 1 (in) by the input's feature dim
        return (Shard(0), Shard(1), Shard(0)) if flip else (Shard(1), Shard(0), Shard(0))

    def bias_placements(self, flip: bool = False):
        return (Shard(0), Replicate(), Replicate()) if flip else (Replicate(), Shard(0), Replicate())

    def norm_placements(self):
        return (Shard(0), Replicate(), Replicate())  # L0: features split by p

    def linear(self, x, w, b, flip: bool, label: str):
        feat, seq = self._roles(flip)
        x = self.inputs.gather(x, 0, seq, label)  # q/k/v (and w1/w3) share one gather of their input
        w = all_gather(w, 0, self.gr, label)
        y = reduce_scatter(F.linear(x, w), 0, feat, label)
        if b is not None:
            y = y + copy_to(b, [feat, self.gr], label)
        return y

    def embed(self, tokens, w, vocab: int, label: str):
        self.inputs.clear()
        table = all_gather(w, 0, self.gr, label)  # vocabulary block q', features p
        partial = vocab_lookup(rows(tokens, self.r, self.q), table, self.qq * (vocab // self.q))
        return reduce_scatter(partial, 0, self.gq, label)

    def feature_sum(self, x, label: str):
        return all_reduce(x, self.gp, label)

    def norm_weight(self, w, label: str):
        return copy_to(w, [self.gq, self.gr], label)

    def loss(self, logits, targets, reduction: str = "mean", label: str = "loss"):
        self.inputs.clear()
        vocab = logits.shape[-1] * self.q
        mine = rows(targets, self.r * self.q + self.p, self.q * self.q, IGNORE_INDEX)
        return vocab_parallel_loss(logits, mine, self.gq, self.qq * (vocab // self.q), [self.gp, self.gr],
                                   int((targets != IGNORE_INDEX).sum()), reduction, label)
