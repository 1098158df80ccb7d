"""2D tensor parallelism (SUMMA, as Optimus and Colossal-AI's 2D): a ``q x q`` grid of ranks ``(i, j)``.

Layout: every activation is split over the grid, the batch by rows (rank ``(i, j)`` holds sequences of
chunk ``i``) and the features by columns (slice ``j``). A linear layer ``y = x W^T`` with ``W`` of shape
``(out, in)`` keeps block ``(out block j, in block i)`` on rank ``(i, j)``: 1/q^2 of every weight.
SUMMA's ``q`` broadcast steps (row ``i``'s blocks of ``x`` along the row, column ``j``'s blocks of ``W``
along the column) are done as one all-gather of each, the same bytes sent:

    x[i, :] = all_gather_j(x[i, j]);   W[j, :] = all_gather_i(W[j, i]);   y[i, j] = x[i, :] W[j, :]^T

Backward is their transpose: reduce-scatters of ``dx`` along the row and of ``dW`` along the column.
Linears that read the same input (q/k/v; w1/w3) share one gather of it.
The output ``y[i, j]`` is in the input's layout, so blocks chain with no re-layout; attention runs on
the local sequences and the heads of column ``j``. The embedding is split as the output head's weight
(vocabulary block ``j``, features block ``i``: tied embeddings share it): gathered along the column, looked
up for the row's tokens in vocabulary block ``j``, reduce-scattered along the row into feature slice
``j``. Norms all-reduce the sum of squares along the row; the loss is vocabulary-parallel along the row
and summed over rows. Depth (:mod:`.tesseract_2p5d`) repeats this grid and splits the batch further.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from .collectives import all_gather, all_reduce, copy_to, reduce_scatter
from .layers import IGNORE_INDEX, SharedInput, rows, vocab_lookup, vocab_parallel_loss


class Summa2D:
    """The 2D grid (depth 1) on a mesh whose dims are ``[tp_dep,] tp_row, tp_col``."""

    mode = "2d"

    def __init__(self, mesh):
        self.mesh = mesh
        names = mesh.mesh_dim_names
        self.has_depth = "tp_dep" in names
        self.q = mesh.size(names.index("tp_col"))
        self.depth = mesh.size(names.index("tp_dep")) if self.has_depth else 1
        self.i, self.j = mesh.get_local_rank("tp_row"), mesh.get_local_rank("tp_col")
        self.k = mesh.get_local_rank("tp_dep") if self.has_depth else 0
        self.g_row = mesh.get_group("tp_row")  # ranks (k, *, j): the same features, other sequences
        self.g_col = mesh.get_group("tp_col")  # ranks (k, i, *): the same sequences, other features
        self.g_dep = mesh.get_group("tp_dep") if self.has_depth else None
        self.inputs = SharedInput()

    @property
    def row_parts(self) -> int:
        return self.depth * self.q

    @property
    def row_index(self) -> int:
        return self.k * self.q + self.i

    def _placements(self, *grid):
        return ((Replicate(),) if self.has_depth else ()) + tuple(grid)

    def weight_placements(self, flip: bool = False):
        return self._placements(Shard(1), Shard(0))  # rows of the grid split ``in``, columns split ``out``

    def bias_placements(self, flip: bool = False):
        return self._placements(Replicate(), Shard(0))

    def norm_placements(self):
        return self._placements(Replicate(), Shard(0))

    def linear(self, x, w, b, flip: bool, label: str):
        x = self.inputs.gather(x, -1, self.g_col, label)
        w = all_gather(copy_to(w, [self.g_dep], label), 1, self.g_row, label)
        b = None if b is None else copy_to(b, [self.g_row, self.g_dep], label)
        return F.linear(x, w, b)

    def embed(self, tokens, w, vocab: int, label: str):
        self.inputs.clear()
        table = all_gather(copy_to(w, [self.g_dep], label), 1, self.g_row, label)
        partial = vocab_lookup(rows(tokens, self.row_index, self.row_parts), table, self.j * (vocab // self.q))
        return reduce_scatter(partial, -1, self.g_col, label)

    def feature_sum(self, x, label: str):
        return all_reduce(x, self.g_col, label)

    def norm_weight(self, w, label: str):
        return copy_to(w, [self.g_row, self.g_dep], label)

    def loss(self, logits, targets, reduction: str = "mean", label: str = "loss"):
        self.inputs.clear()
        vocab, n_tokens = logits.shape[-1] * self.q, int((targets != IGNORE_INDEX).sum())
        mine = rows(targets, self.row_index, self.row_parts, IGNORE_INDEX)
        return vocab_parallel_loss(logits, mine, self.g_col, self.j * (vocab // self.q), [self.g_row, self.g_dep],
                                   n_tokens, reduction, label)
