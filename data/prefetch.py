"""Background prefetch: build the next batches on a thread while the current step computes.

On CUDA, batches are pinned and copied with ``non_blocking=True`` on a side stream of their own, so
the copy of batch k+1 overlaps the step on batch k (what a hand-written ``DataLoaderX`` with a
``torch.cuda.Stream`` does). Each batch carries the event recorded after its copy: the consumer's
stream waits on it before the batch is used, and every tensor of the batch is marked as used by the
consumer's stream (``record_stream``), so the caching allocator never hands its memory to the side
stream while the step still reads it. On CPU, batches are handed over as they are.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterable

import torch

_DONE = object()


def tensors(batch) -> list[torch.Tensor]:
    """Every tensor of a batch (a tensor, list, tuple, dict or dataclass of them)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for b in batch for t in tensors(b)]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [t for f in dataclasses.fields(batch) for t in tensors(getattr(batch, f.name))]
    return []


def to_device(batch, device: torch.device | str):
    """A batch (a tensor, lists / tuples / dicts / a dataclass of them) on ``device``; anything else as it is."""
    if isinstance(batch, torch.Tensor):
        if torch.device(device).type == "cuda":
            return batch.pin_memory().to(device, non_blocking=True)
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):  # a typed batch: each of its tensors
        return dataclasses.replace(batch, **{f.name: to_device(getattr(batch, f.name), device)
                                             for f in dataclasses.fields(batch) if f.init})
    return batch


class Prefetcher:
    """Iterate ``make(key)`` for each key, computed up to ``depth`` keys ahead on a daemon thread."""

    def __init__(self, make: Callable, keys: Iterable, device: str | torch.device = "cpu", depth: int = 2):
        self._make, self._keys, self._device = make, keys, torch.device(device)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        # the side stream the copies go on (CUDA only; None elsewhere)
        self.stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, name="prunus-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _moved(self, batch):
        """``batch`` on the device, and the event its copy recorded (None off CUDA)."""
        if self.stream is None:
            return to_device(batch, self._device), None
        with torch.cuda.stream(self.stream):
            moved = to_device(batch, self._device)
            done = torch.cuda.Event()
            done.record(self.stream)
        return moved, done

    def _run(self) -> None:
        try:
            for key in self._keys:
                if not self._put((key, *self._moved(self._make(key)))):
                    return
        except BaseException as e:  # re-raised in the consumer
            self._put(e)
            return
        self._put(_DONE)

    def __iter__(self):
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            key, batch, done = item
            if done is not None:
                consumer = torch.cuda.current_stream(self._device)
                consumer.wait_event(done)
                for t in tensors(batch):
                    if t.device.type == "cuda":
                        t.record_stream(consumer)
            yield key, batch

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
