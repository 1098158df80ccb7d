"""Dynamic batching for non-generative models: concurrent callers' rows merged into one forward pass.

Each :meth:`DynamicBatcher.submit` queues one caller's batch (rows of the model's input). The batcher's one
thread takes the oldest waiting request, then waits up to ``max_delay_ms`` from its arrival for more, taking
requests in arrival order while their rows fit in ``max_batch``; it concatenates them, runs the backend's
``predict`` once, and splits the outputs back per caller. A request of more rows than ``max_batch`` runs
alone, in passes of ``max_batch`` rows. A full wait queue (``max_queue`` requests) raises
:class:`~prunus.serve.scheduler.QueueFull` at once; a failed pass fails each of its requests with its error.

Counters for ``/metrics``: passes, rows and requests per pass (occupancy: rows / ``max_batch``), and the most
requests merged into one pass.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future

import numpy as np

from .scheduler import QueueFull


class DynamicBatcher:
    start_error = None  # the generative scheduler's fields the Engine reads
    threads = None
    tokens_generated = 0

    def __init__(self, backend, max_delay_ms: float = 2.0, max_queue: int | None = None):
        self.backend, self.max_queue = backend, max_queue
        self.max_batch = backend.capabilities.max_batch
        self.max_delay_s = max(0.0, float(max_delay_ms)) / 1000.0
        self.waiting: deque = deque()  # (arrival time, batch, Future)
        self.passes = self.rows = self.requests = self.max_requests_in_pass = 0
        self._busy = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="prunus-dynamic-batcher", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def n_active(self) -> int:
        return self._busy

    def submit(self, batch: np.ndarray) -> Future:
        """A Future of ``batch``'s outputs; QueueFull when ``max_queue`` requests wait already."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise QueueFull("the engine is closed; load it again")
            if self.max_queue is not None and len(self.waiting) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting); retry later")
            self.waiting.append((time.monotonic(), batch, future))
            self._cond.notify()
        return future

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        for _, _, future in self.waiting:
            future.cancel()

    def _take(self) -> list | None:
        """The requests of the next pass, or None once closed."""
        with self._cond:
            while not self.waiting and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            deadline = self.waiting[0][0] + self.max_delay_s
            while not self._closed and sum(len(b) for _, b, _ in self.waiting) < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            taken = [self.waiting.popleft()]
            rows = len(taken[0][1])
            while self.waiting and rows + len(self.waiting[0][1]) <= self.max_batch:
                rows += len(self.waiting[0][1])
                taken.append(self.waiting.popleft())
            self._busy = len(taken)
            return taken

    def _loop(self) -> None:
        while (taken := self._take()) is not None:
            futures = [f for _, _, f in taken if f.set_running_or_notify_cancel()]
            batches = [b for _, b, f in taken if not f.cancelled()]
            try:
                if futures:
                    self._run(batches, futures)
            except BaseException as e:  # noqa: BLE001 - every caller of the pass learns why; the thread goes on
                for f in futures:
                    if not f.done():
                        f.set_exception(e)
            finally:
                self._busy = 0

    def _run(self, batches: list[np.ndarray], futures: list[Future]) -> None:
        merged = batches[0] if len(batches) == 1 else np.concatenate(batches)
        outs = [self.backend.predict(merged[i:i + self.max_batch]) for i in range(0, len(merged), self.max_batch)]
        out = outs[0] if len(outs) == 1 else np.concatenate(outs)
        with self._cond:
            self.passes += len(outs)
            self.rows += len(merged)
            self.requests += len(batches)
            self.max_requests_in_pass = max(self.max_requests_in_pass, len(batches))
        start = 0
        for batch, future in zip(batches, futures):
            future.set_result(out[start:start + len(batch)])
            start += len(batch)

    def metrics_lines(self) -> list[str]:
        """Prometheus text lines of the batching counters."""
        occupancy = self.rows / (self.passes * self.max_batch) if self.passes else 0.0
        return ["# HELP prunus_batch_passes_total Forward passes run by the dynamic batcher.",
                "# TYPE prunus_batch_passes_total counter", f"prunus_batch_passes_total {self.passes}",
                "# HELP prunus_batch_rows_total Input rows through those passes.",
                "# TYPE prunus_batch_rows_total counter", f"prunus_batch_rows_total {self.rows}",
                "# HELP prunus_batch_requests_total Requests merged into those passes.",
                "# TYPE prunus_batch_requests_total counter", f"prunus_batch_requests_total {self.requests}",
                "# HELP prunus_batch_occupancy Mean rows per pass over max batch.",
                "# TYPE prunus_batch_occupancy gauge", f"prunus_batch_occupancy {occupancy:.6f}",
                "# HELP prunus_batch_max_requests_per_pass The most requests merged into one pass.",
                "# TYPE prunus_batch_max_requests_per_pass gauge",
                f"prunus_batch_max_requests_per_pass {self.max_requests_in_pass}"]


def as_torch_future(future: Future) -> Future:
    """A Future of the torch tensor of ``future``'s numpy result."""
    import torch

    out = Future()

    def done(f):
        if f.cancelled():
            out.cancel()
        elif f.exception() is not None:
            out.set_exception(f.exception())
        else:
            out.set_result(torch.from_numpy(f.result()))

    future.add_done_callback(done)
    return out
