"""2.5D tensor parallelism (Tesseract): ``d`` layers of the 2D ``q x q`` grid, ``tp = q * q * d``.

Each depth layer ``k`` is a SUMMA grid (:mod:`.summa_2d`) on its own part of the batch (the batch is
split into ``d * q`` parts: layer ``k``, row ``i``); the weights are split over the ``q x q`` grid and
replicated over the depth, so per-rank weight memory is that of 2D at ``q`` while the activation
traffic of each grid shrinks with its smaller batch. The depth's only extra traffic is the all-reduce of
weight gradients over the ``d`` layers (``copy_to`` on the depth group), done in backward.
"""

from __future__ import annotations

from .summa_2d import Summa2D


class Tesseract2p5D(Summa2D):
    """The 2D grid with a depth dimension (mesh dims ``tp_dep, tp_row, tp_col``)."""

    mode = "2.5d"
