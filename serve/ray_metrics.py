"""``/metrics`` of ``prunus serve --replicas N``: every replica's Prometheus registry, each sample labelled
``replica``, in one exposition.

Each replica pushes its registry's text (the one-process server's :class:`prunus.serve.metrics.Metrics`, and its
engine's prefix-cache counts) to a board every :data:`PUSH_EVERY_S` seconds; the board is a Ray actor named per
application. ``GET /metrics`` on the ingress reads the board, keeps the replicas heard from in the last
:data:`STALE_S` seconds (one that died drops out), and merges their families: one ``# HELP`` / ``# TYPE`` per
family, its samples from every replica with ``replica="ID"`` added.
"""

from __future__ import annotations

import time

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

PUSH_EVERY_S = 0.5
STALE_S = 5.0
NAMESPACE = "prunus"
PREFIX_COUNTS = (("lookups", "Prompts looked up in the prefix cache."),
                 ("hits", "Prompts that found a cached prefix."),
                 ("prompt_tokens", "Prompt tokens looked up."),
                 ("reused_tokens", "Prompt tokens restored from the cache instead of computed."))


def board_name(app_name: str) -> str:
    return f"prunus-metrics-{app_name}"


class MetricsBoard:
    """The latest registry text of each replica (a Ray actor: ``ray.remote(num_cpus=0)(MetricsBoard)``)."""

    def __init__(self):
        self.texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def drop(self, replica: str) -> None:
        self.texts.pop(replica, None)

    def fresh(self, max_age_s: float = STALE_S) -> dict[str, str]:
        now = time.monotonic()
        return {r: text for r, (at, text) in self.texts.items() if now - at <= max_age_s}


class PrefixCacheCollector:
    """The engine's prefix-cache counts (its info's ``prefix_cache``, a live dict) as counters."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.info.get("prefix_cache") or {}
        for name, text in PREFIX_COUNTS:
            yield CounterMetricFamily(f"prunus_prefix_cache_{name}", text, value=stats.get(name, 0))


def replica_text(server) -> str:
    """A replica's registry text: the server's metrics and its engine's prefix-cache counts."""
    extra = CollectorRegistry()
    extra.register(PrefixCacheCollector(server.engine))
    return server.metrics.render().decode() + prometheus_client.generate_latest(extra).decode()


class _Merged:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def merge(texts: dict[str, str]) -> bytes:
    """One exposition of the replicas' texts ({replica: text}), each sample labelled ``replica``."""
    families: dict[str, object] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, _empty(family))
            merged.samples += [Sample(s.name, {"replica": replica, **s.labels}, s.value, s.timestamp, s.exemplar)
                               for s in family.samples]
    registry = CollectorRegistry()
    registry.register(_Merged(list(families.values())))
    return prometheus_client.generate_latest(registry)


def _empty(family):
    from prometheus_client.metrics_core import Metric

    return Metric(family.name, family.documentation, family.type, family.unit)
