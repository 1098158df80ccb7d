"""The gradients ``prune_channels``' ``taylor`` importance ranks by.

torch-pruning's ``GroupTaylorImportance`` scores a channel by ``|weight * gradient|`` summed over every tensor of
its group: the first-order estimate of how much the task's loss would change without it. The gradients are those of
the task's loss on samples of the training split (``CALIB_SAMPLES`` spread evenly over it, so a split listed class by
class still gives every class), accumulated in eval mode (BatchNorm statistics and dropout as at inference) before
each pruning step, and cleared after the cut.
"""

from __future__ import annotations

import torch
from torch import nn

CALIB_SAMPLES, CALIB_BATCH = 256, 64


def spread(n: int, k: int) -> list[int]:
    """``min(n, k)`` indices evenly spaced over ``0 .. n - 1``."""
    return list(range(n)) if k >= n else [round(i * (n - 1) / max(k - 1, 1)) for i in range(k)]


class TaylorBatches:
    """Batches of the training split and the task's loss: :meth:`accumulate` leaves the loss's gradients in
    ``model``'s parameters."""

    def __init__(self, dataset, loss, samples: int = CALIB_SAMPLES, batch: int = CALIB_BATCH):
        from torch.utils.data import default_collate

        picked = spread(len(dataset), samples)
        self.batches = [default_collate([dataset[i] for i in picked[s:s + batch]])
                        for s in range(0, len(picked), batch)]
        self.loss = loss

    def accumulate(self, model: nn.Module) -> None:
        model.eval()
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            for x, y in self.batches:
                (self.loss(model(x), y) * len(x) / CALIB_SAMPLES).backward()

    @staticmethod
    def clear(model: nn.Module) -> None:
        model.zero_grad(set_to_none=True)
