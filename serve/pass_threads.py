"""How many threads each forward pass of the in-process torch backend uses, chosen by timing at load.

A decode step of a small model is a few hundred tiny operators. Each one that runs in
parallel wakes the other OpenMP threads, and with ``OMP_WAIT_POLICY=PASSIVE`` (sleeping,
not spinning, threads) that wake-up costs more than a small matmul takes: on a 2-core
machine the demo model decoded a batch of 8 faster on 1 thread than on 2. A large model
wants every core. Rather than guess, the scheduler times a few
passes at 1 thread and at the process's thread count, for a decode of one row, a
decode of the full batch and a prefill, and gives each later pass the faster setting
of the tuned pass nearest its size in tokens.

OpenMP's thread count is a setting of the calling thread, so the scheduler thread sets
its own and the rest of the process keeps its setting.
"""

from __future__ import annotations

import math
import time

import torch

PREFILL_WIDTH = 16  # tokens per prompt in the tuned prefill pass
BIG_PASS_S = 0.05  # a one-row decode this slow on all threads: the model is big, all threads win, skip timing


class PassThreads:
    """Threads per pass size (tokens in the pass); ``set(tokens)`` applies it to the calling thread."""

    def __init__(self, by_tokens: dict[int, int]):
        self.by_tokens = dict(sorted(by_tokens.items()))
        self._current: int | None = None

    @classmethod
    def fixed(cls, threads: int) -> "PassThreads":
        return cls({1: threads})

    def for_tokens(self, tokens: int) -> int:
        size = min(self.by_tokens, key=lambda s: abs(math.log(s) - math.log(max(tokens, 1))))
        return self.by_tokens[size]

    def set(self, tokens: int) -> None:
        n = self.for_tokens(tokens)
        if n != self._current:
            torch.set_num_threads(n)
            self._current = n

    def describe(self) -> dict[str, int]:
        return {f"{tokens} tokens": n for tokens, n in self.by_tokens.items()}


def tune_pass_threads(backend, max_threads: int, steps: int = 3, rounds: int = 2) -> PassThreads:
    """Time ``backend``'s passes at 1 and ``max_threads`` threads; the caller's thread count is changed.

    Uses the backend's cache rows as scratch: every row is free while the engine starts,
    and a request's prefill starts its row afresh. A model whose one-row decode takes over
    ``BIG_PASS_S`` on all threads gets all threads without the rest of the timing (which
    would take seconds at that size, and all threads win there).
    """
    candidates = sorted({1, max_threads})
    if len(candidates) == 1:
        return PassThreads.fixed(max_threads)
    n = backend.n_slots
    width = max(1, min(PREFILL_WIDTH, backend.max_len - steps - 2))

    def decode_pass(batch):
        rows = list(range(batch))
        backend.prefill(rows, [[0]] * batch)
        return lambda: backend.decode(rows, [0] * batch)

    def prefill_pass():
        rows = list(range(n))
        return lambda: backend.prefill(rows, [[0] * width] * n)

    torch.set_num_threads(max_threads)
    one_row = decode_pass(1)
    one_row()
    t0 = time.perf_counter()
    one_row()
    if time.perf_counter() - t0 > BIG_PASS_S:
        return PassThreads.fixed(max_threads)
    passes = {1: lambda: decode_pass(1), n: lambda: decode_pass(n), n * width: prefill_pass}
    by_tokens: dict[int, int] = {}
    for tokens, make in passes.items():
        seconds = {t: math.inf for t in candidates}
        for _ in range(rounds):  # alternate the settings, keep each one's best
            for threads in candidates:
                torch.set_num_threads(threads)
                run = make()
                run()  # warm-up
                t0 = time.perf_counter()
                for _ in range(steps):
                    run()
                seconds[threads] = min(seconds[threads], (time.perf_counter() - t0) / steps)
        by_tokens[tokens] = min(seconds, key=seconds.get)
    return PassThreads(by_tokens)
