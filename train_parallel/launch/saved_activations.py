"""Bytes autograd keeps for backward, counted exactly: the measured side of the dry run's estimate.

    with SavedActivations(model) as saved:
        logits = model(x)
        loss = cross_entropy(logits, y)
    saved.add(logits)  # held for the loss
    saved.bytes

Every floating-point tensor autograd saves inside the block is counted once per distinct
storage (views of one activation share it); the module's own parameters and buffers are
not activations and are left out. Device-independent, so CPU runs measure what a GPU holds.
"""

from __future__ import annotations

import torch
from torch import nn


class SavedActivations:
    def __init__(self, model: nn.Module):
        self._owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self._storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype.is_floating_point and t.untyped_storage().data_ptr() not in self._owned:
            self.add(t)
        return t

    def add(self, t: torch.Tensor) -> None:
        """Count a tensor kept outside autograd too (the logits held for the loss)."""
        self._storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
