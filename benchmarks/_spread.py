"""Repeated timings, their spread, and whether a difference between two is within noise.

A latency figure from one run swings by 2x on a shared machine, so the benchmarks time each
callable several times (alternating, so drift hits all alike), print the median with the
interquartile range, and mark a ratio whose two ranges overlap as within noise ("≈").
"""

from __future__ import annotations

import statistics
import time


def alternating_samples(fns: dict, reps: int) -> dict[str, list[float]]:
    """Seconds of each of ``reps`` calls of each fn (after one warm-up call each), calls alternating."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def spread(samples: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of the samples; min and max when there are fewer than 4."""
    s = sorted(samples)
    if len(s) < 4:
        return s[0], statistics.median(s), s[-1]
    q1, q2, q3 = statistics.quantiles(s, n=4, method="inclusive")
    return q1, q2, q3


def overlap(a: list[float], b: list[float]) -> bool:
    """Whether the spreads of two sets of samples overlap: their difference is within noise."""
    a_lo, _, a_hi = spread(a)
    b_lo, _, b_hi = spread(b)
    return a_lo <= b_hi and b_lo <= a_hi


def ms(samples: list[float]) -> str:
    """Median milliseconds and the spread: ``1.23 [1.10–1.40]``."""
    lo, mid, hi = spread(samples)
    return f"{1e3 * mid:.2f} [{1e3 * lo:.2f}–{1e3 * hi:.2f}]"


def ratio(a: list[float], b: list[float], spec: str = ".3f") -> str:
    """The ratio of medians a / b, marked ``≈`` (within noise) when the spreads overlap."""
    r = format(statistics.median(a) / statistics.median(b), spec)
    return f"≈ {r}" if overlap(a, b) else r


NOTE = "ms: median [interquartile range] of the repetitions; ≈: the two spreads overlap, a difference within noise"
