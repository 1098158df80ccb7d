"""The prefix-aware request router of ``prunus serve --replicas N`` (Ray Serve's ``RequestRouter``; the design of
Ray's own ``PrefixCacheAffinityRouter``, with the tree kept in the router).

A request to the replicas is a :class:`prunus.serve.ray_ingress.Parcel` (the HTTP request the ingress read); its
prompt text is the JSON body's ``prompt`` (a string, or the strings of a list) or its ``messages``' contents.
For each request:

1. the replicas' loads (requests in progress, from Ray's cache of them or probed): when the busiest has more
   than ``imbalanced_threshold`` above the idlest, Ray's power of two choices decides;
2. else the prompt is matched against the prefix tree (:mod:`prunus.serve.ray_prefix_tree`): when at least
   ``match_rate_threshold`` of it matched, the replicas holding the longest match are the candidates (Ray sends
   it to the least loaded of them); below it, the replicas holding the least text, so new prefixes spread;
3. the replica it was routed to is recorded in the tree under the prompt (:meth:`on_request_routed`).

A request with no prompt (GET routes, the Open Inference Protocol's tensors) and a request for a LoRA adapter
(Ray's model multiplexing: the replicas that hold it) go by the power of two choices. A replica that dies or
leaves is removed from the tree.
"""

from __future__ import annotations

import json

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from .ray_prefix_tree import MAX_PROMPT_CHARS, PrefixTree

MAX_PARSED_BYTES = 1 << 20  # a body larger than this is routed without its prompt


def prompt_text(body: bytes) -> str | None:
    """The text a request's prefix is matched on, from its JSON body; None when it has none."""
    if not body or len(body) > MAX_PARSED_BYTES:
        return None
    try:
        req = json.loads(body)
    except ValueError:
        return None
    if not isinstance(req, dict):
        return None
    prompt = req.get("prompt", req.get("messages"))
    text = _text(prompt)
    return text[:MAX_PROMPT_CHARS] or None


def _text(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(v) for v in value if not isinstance(v, int))
    if isinstance(value, dict):
        return value.get("role", "") + ":" + _text(value.get("content", value.get("text")))
    return ""


def request_text(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or pending_request.metadata.multiplexed_model_id:
        return None
    for arg in pending_request.args or ():
        body = getattr(arg, "body", None)
        if isinstance(body, bytes):
            return prompt_text(body)
    return None


class PrefixAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """See the module docstring; ``request_router_kwargs`` set the thresholds."""

    def initialize_state(self, imbalanced_threshold: float = 2, match_rate_threshold: float = 0.1, **kwargs):
        self.imbalanced_threshold, self.match_rate_threshold = imbalanced_threshold, match_rate_threshold
        self.tree = PrefixTree()

    async def _loads(self, replicas: list[RunningReplica]) -> list[int]:
        loads, probe = [], []
        for r in replicas:
            n = self.replica_queue_len_cache.get(r.replica_id)
            (probe.append(r) if n is None else loads.append(n))
        if probe:
            loads += [n for _, n in await self._probe_queue_lens(probe, 0) if n is not None]
        return loads

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        text = request_text(pending_request)
        if text is None or len(candidate_replicas) < 2:
            return await super().choose_replicas(candidate_replicas, pending_request)
        loads = await self._loads(candidate_replicas)
        if loads and max(loads) - min(loads) > self.imbalanced_threshold:
            return await super().choose_replicas(candidate_replicas, pending_request)
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        matched, holders = self.tree.match(text, list(by_id))
        chosen = holders if matched / len(text) >= self.match_rate_threshold else self.tree.smallest(list(by_id))
        return [[by_id[t] for t in chosen]] if chosen else await super().choose_replicas(candidate_replicas,
                                                                                         pending_request)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        text = request_text(pending_request)
        if text is not None:
            self.tree.insert(text, replica_id.to_full_id_str())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.tree.remove_tenant(replica_id.to_full_id_str())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.to_full_id_str() for r in self._replica_id_set}
        super().update_replicas(replicas)
        after = {r.to_full_id_str() for r in self._replica_id_set}
        for gone in before - after:
            self.tree.remove_tenant(gone)
        for new in after - before:
            self.tree.add_tenant(new)
