"""Background prefetch: build the next batches on a thread while the current step computes.

On CUDA, batches are pinned and copied with ``non_blocking=True`` so the copy
overlaps compute; on CPU they are handed over as they are.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterable

import torch

_DONE = object()


def to_device(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        if device.type == "cuda":
            return batch.pin_memory().to(device, non_blocking=True)
        return batch.to(device)
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

    def _run(self) -> None:
        try:
            for key in self._keys:
                if not self._put((key, to_device(self._make(key), self._device))):
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
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
