"""Server metrics in the Prometheus text format (no client library: a few counters and one histogram)."""

from __future__ import annotations

import math
import threading
from collections import Counter

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, math.inf)


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter[int] = Counter()  # by HTTP status
        self.latency_counts = [0] * len(LATENCY_BUCKETS)
        self.latency_sum = 0.0
        self.latency_n = 0

    def observe(self, status: int, latency_s: float | None = None) -> None:
        with self._lock:
            self.requests[status] += 1
            if latency_s is not None:
                self.latency_sum += latency_s
                self.latency_n += 1
                for i, le in enumerate(LATENCY_BUCKETS):
                    if latency_s <= le:
                        self.latency_counts[i] += 1

    def render(self, scheduler) -> str:
        with self._lock:
            lines = ["# HELP prunus_requests_total Completion requests answered, by HTTP status.",
                     "# TYPE prunus_requests_total counter"]
            lines += [f'prunus_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())]
            lines += ["# HELP prunus_tokens_generated_total Tokens sampled by the engine.",
                      "# TYPE prunus_tokens_generated_total counter",
                      f"prunus_tokens_generated_total {scheduler.tokens_generated}",
                      "# HELP prunus_queue_depth Requests waiting for a batch slot.",
                      "# TYPE prunus_queue_depth gauge",
                      f"prunus_queue_depth {scheduler.queue_depth}",
                      "# HELP prunus_active_requests Requests in the running batch.",
                      "# TYPE prunus_active_requests gauge",
                      f"prunus_active_requests {scheduler.n_active}",
                      "# HELP prunus_request_latency_seconds Time from a completion request to its last token.",
                      "# TYPE prunus_request_latency_seconds histogram"]
            for le, n in zip(LATENCY_BUCKETS, self.latency_counts):
                lines.append(f'prunus_request_latency_seconds_bucket{{le="{"+Inf" if le == math.inf else le}"}} {n}')
            lines += [f"prunus_request_latency_seconds_sum {self.latency_sum:.6f}",
                      f"prunus_request_latency_seconds_count {self.latency_n}"]
        return "\n".join(lines) + "\n"
