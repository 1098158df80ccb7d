"""The server's metrics, through prometheus_client, in a registry of its own (one per server).

* ``prunus_requests_total{status}``: answers to POST requests (and to requests refused at the door or at the
  connection cap), by HTTP status;
* ``prunus_request_latency_seconds``: a histogram of the time from a request to the end of its 200 answer;
* ``prunus_tokens_generated_total``, ``prunus_queue_depth``, ``prunus_active_requests``: read from the engine's
  scheduler at each scrape; with speculative decoding also ``prunus_speculative_steps_total``,
  ``prunus_speculative_drafted_tokens_total``, ``prunus_speculative_accepted_tokens_total`` and
  ``prunus_speculative_speedup`` (once a step of the target alone was timed), and per draft source (``eagle``,
  ``ngram3`` .. ``ngram1`` by the length of the prompt-lookup match, ``model``)
  ``prunus_speculative_source_drafted_tokens_total{source}`` and ``..._source_accepted_tokens_total{source}``.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

prometheus_client.disable_created_metrics()  # no *_created series beside each counter


class _SchedulerCollector:
    def __init__(self, scheduler):
        self.scheduler = scheduler

    def collect(self):
        s = self.scheduler
        yield CounterMetricFamily("prunus_tokens_generated", "Tokens sampled by the engine.", value=s.tokens_generated)
        yield GaugeMetricFamily("prunus_queue_depth", "Requests waiting for a batch slot.", value=s.queue_depth)
        yield GaugeMetricFamily("prunus_active_requests", "Requests in the running batch.", value=s.n_active)
        speculator = getattr(s, "speculator", None)
        if speculator is not None:  # speculative decoding: prunus.runtime.speculative
            st = speculator.stats
            yield CounterMetricFamily("prunus_speculative_steps", "Speculative decoding steps (one target pass each).",
                                      value=st["steps"])
            yield CounterMetricFamily("prunus_speculative_drafted_tokens", "Tokens drafted.", value=st["drafted"])
            yield CounterMetricFamily("prunus_speculative_accepted_tokens", "Drafted tokens the target accepted.",
                                      value=st["accepted"])
            yield from _by_source(st["sources"])
            if st["speedup"] is not None:
                yield GaugeMetricFamily("prunus_speculative_speedup", "Tokens per second of speculative steps over "
                                        "plain decoding's (timed on steps of the target alone).", value=st["speedup"])


def _by_source(sources: dict):
    for key, what in (("drafted", "Tokens drafted"), ("accepted", "Drafted tokens the target accepted")):
        family = CounterMetricFamily(f"prunus_speculative_source_{key}_tokens", f"{what}, by draft source.",
                                     labels=["source"])
        for source, counts in sorted(sources.items()):
            family.add_metric([source], counts[key])
        yield family


class Metrics:
    def __init__(self, scheduler):
        self.registry = CollectorRegistry()
        self.requests = Counter("prunus_requests", "Requests answered, by HTTP status.", ["status"],
                                registry=self.registry)
        self.latency = Histogram("prunus_request_latency_seconds", "Time from a request to the end of its answer.",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_SchedulerCollector(scheduler))
        self.scheduler = scheduler

    def observe(self, status: int, latency_s: float | None = None) -> None:
        self.requests.labels(status=str(status)).inc()
        if latency_s is not None:
            self.latency.observe(latency_s)

    def render(self) -> bytes:
        text = prometheus_client.generate_latest(self.registry)
        extra = getattr(self.scheduler, "metrics_lines", None)  # the dynamic batcher's own counters
        return text + ("\n".join(extra()) + "\n").encode() if extra is not None else text
