"""A shuffled stream of tar-shard samples (:mod:`.tar_shards`), split by rank and DataLoader worker, that
resumes at the exact sample a step left it.

Reader ``r * W + w`` (rank ``r`` of ``R``, DataLoader worker ``w`` of ``W``) reads, each epoch, the shards at
positions ``r * W + w``, ``+ R * W``, ... of that epoch's seeded shard order, their samples through a
shuffle buffer seeded by (seed, epoch, reader): so shards are read front to back, each by one reader. A
worker yields whole batches and the DataLoader takes them round-robin, so batch ``j`` of a rank comes from
worker ``j % W``. Every choice is computed from the scanned index (no bytes are read to skip), so a run
resumed at step ``s`` starts each worker past the batches it gave before ``s``: the same samples, in the same
order, as a run that never stopped. The position is the step in the checkpoint, as for the other data; the
number of readers is kept beside it, and a resume with another one is refused in one line. Since the samples
of a step depend on the number of readers, a stream does not give every layout one process's global batches
(the map-style datasets do, through :class:`.global_batches.GlobalBatches`).
"""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from prunus.artifacts.errors import PrunusError

from .tar_shards import TarSample, TarSampleDataset


class Refused:
    """A sample's one-line refusal raised in a DataLoader worker, carried to the rank as a batch (torch would
    re-raise it wrapped in the worker's traceback); :meth:`ShardBatches.batch` raises it there."""

    def __init__(self, message: str):
        self.message = message


class TarShardStream(IterableDataset):
    """The training samples of a shard dir: iterated as the stream above, indexed for checks (``dataset[i]``)."""

    finite_checked = True  # every float sample is checked at decode (image_decode.check_finite)

    def __init__(self, by_shard: list[list[TarSample]], classes: list[str] | None, *, buffer: int = 256,
                 limit: int | None = None):
        self.by_shard, self.buffer = [s for s in by_shard if s], buffer
        self.index = TarSampleDataset([s for shard in self.by_shard for s in shard], classes, limit)
        self.classes, self.shape = classes, self.index.shape
        self.seed, self.rank, self.world, self.local_batch, self.start_step = 0, 0, 1, 1, 0

    @property
    def num_classes(self) -> int:
        return self.index.num_classes

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        return self.index[i]

    def readers_check(self, readers: int) -> None:
        if len(self.by_shard) < readers:
            raise PrunusError(f"--data {self.by_shard[0][0].shard.parent}: {len(self.by_shard)} shards for {readers} "
                              "readers (ranks x --data-workers); write more, smaller shards or use fewer workers")

    def epoch_order(self, epoch: int, reader: int, readers: int) -> list[TarSample]:
        """Reader ``reader``'s samples in epoch ``epoch``, in the order it yields them (nothing read)."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
        shards = torch.randperm(len(self.by_shard), generator=gen).tolist()[reader::readers]
        gen.manual_seed((self.seed * 1_000_003 + epoch * 65_537 + reader + 1) % 2**63)
        pool, out = [], []
        for sample in (s for i in shards for s in self.by_shard[i]):
            pool.append(sample)
            if len(pool) >= self.buffer:
                out.append(pool.pop(int(torch.randint(len(pool), (), generator=gen))))
        while pool:
            out.append(pool.pop(int(torch.randint(len(pool), (), generator=gen))))
        return out

    def order(self, reader: int, readers: int):
        """Reader ``reader``'s endless sample order, epoch after epoch."""
        for epoch in itertools.count():
            yield from self.epoch_order(epoch, reader, readers)

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        readers = self.world * workers
        self.readers_check(readers)
        # a loader started at step s gives step s from its worker 0: worker w plays the part of the reader that
        # gives steps s + w, s + w + W, ..., and skips the batches that reader gave before s
        part = (self.start_step + worker) % workers
        done = max(0, (self.start_step - part + workers - 1) // workers)
        order = self.order(self.rank * workers + part, readers)
        next(itertools.islice(order, done * self.local_batch, done * self.local_batch), None)  # skip, nothing read
        while True:
            try:
                batch = default_collate([self.index.load(s) for s in itertools.islice(order, self.local_batch)])
            except PrunusError as e:
                yield Refused(str(e))
                return
            yield batch


class ShardBatches:
    """``batch(step)`` of a :class:`TarShardStream`, for the trainer (the steps asked must follow each other)."""

    def __init__(self, stream: TarShardStream, batch_size: int, *, seed: int, rank: int = 0, world: int = 1,
                 workers: int = 0):
        if batch_size % world:
            raise PrunusError(f"--batch-size {batch_size} is not divisible by the {world} data-parallel ranks; "
                              "choose a multiple")
        stream.readers_check(world * max(workers, 1))
        self.stream, self.workers, self.readers = stream, workers, world * max(workers, 1)
        stream.seed, stream.rank, stream.world, stream.local_batch = seed, rank, world, batch_size // world
        self._it, self._next = None, None

    def batch(self, step: int):
        if self._it is None or step != self._next:
            self.stream.start_step = step
            loader = DataLoader(self.stream, batch_size=None, num_workers=self.workers)
            self._it = iter(loader)
        self._next = step + 1
        batch = next(self._it)
        if isinstance(batch, Refused):
            self._it = None
            raise PrunusError(batch.message)
        return batch
