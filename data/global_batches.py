"""Deterministic global batches of any map-style ``torch.utils.data.Dataset`` of (input, target) samples.

Step ``s`` takes samples ``s * B .. s * B + B - 1`` of an endless stream that visits the dataset once per
epoch in an order seeded by (seed, epoch); data-parallel rank ``r`` of ``R`` takes its ``B / R`` consecutive
samples of that global batch. Every layout therefore sees the same global batch at every step (the
equivalence the engine's tests check), a resumed run continues the same stream, and no sampler state is saved.
A batch holding a NaN or infinity is refused in one line naming its sample (:mod:`.finite`).
"""

from __future__ import annotations

import torch
from torch.utils.data import default_collate

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short

from .finite import check_samples_finite


def check_pair(dataset, source: str = "dataset") -> None:
    """One line unless ``dataset`` is a non-empty map-style dataset whose samples are (input, target) pairs."""
    try:
        n = len(dataset)
    except TypeError:
        raise PrunusError(f"{source}: a {type(dataset).__name__} has no len(); give a map-style torch Dataset of "
                          "(input, target) samples") from None
    if n < 1:
        raise PrunusError(f"{source}: holds no samples; give a dataset of (input, target) samples")
    sample = dataset[0]
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise PrunusError(f"{source}[0] is {short(type(sample).__name__)}, not an (input, target) pair; return "
                          "(input, target) from __getitem__")


class GlobalBatches:
    """``batch(step)`` -> this rank's share of step ``step``'s global batch, collated (see the module docstring)."""

    def __init__(self, dataset, batch_size: int, *, seed: int, rank: int = 0, world: int = 1):
        if batch_size % world:
            raise PrunusError(f"--batch-size {batch_size} is not divisible by the {world} data-parallel ranks; "
                              "choose a multiple")
        self.dataset, self.batch_size, self.seed, self.rank, self.world = dataset, batch_size, seed, rank, world
        self.n = len(dataset)
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:  # a batch spans at most two epochs: older orders are dropped
            self._orders = {e: order for e, order in self._orders.items() if e >= epoch - 1}
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            self._orders[epoch] = torch.randperm(self.n, generator=gen)
        return self._orders[epoch]

    def indices(self, step: int) -> list[int]:
        """This rank's sample indices at ``step``."""
        local = self.batch_size // self.world
        start = step * self.batch_size + self.rank * local
        return [int(self._order(p // self.n)[p % self.n]) for p in range(start, start + local)]

    def batch(self, step: int):
        indices = self.indices(step)
        batch = default_collate([self.dataset[i] for i in indices])
        check_samples_finite(self.dataset, indices, batch)
        return batch


def eval_batches(dataset, batch_size: int, max_samples: int):
    """The first ``max_samples`` samples of ``dataset`` in order, collated ``batch_size`` at a time."""
    n = min(len(dataset), max_samples)
    for start in range(0, n, batch_size):
        indices = list(range(start, min(n, start + batch_size)))
        batch = default_collate([dataset[i] for i in indices])
        check_samples_finite(dataset, indices, batch)
        yield batch


def step_batches(dataset, batch_size: int, *, seed: int, rank: int = 0, world: int = 1, workers: int = 0):
    """What gives the trainer each step's batch: :class:`GlobalBatches`, or for tar shards the stream's
    :class:`~prunus.data.shard_stream.ShardBatches` (read by ``workers`` DataLoader workers)."""
    from .shard_stream import ShardBatches, TarShardStream

    if isinstance(dataset, TarShardStream):
        return ShardBatches(dataset, batch_size, seed=seed, rank=rank, world=world, workers=workers)
    return GlobalBatches(dataset, batch_size, seed=seed, rank=rank, world=world)
