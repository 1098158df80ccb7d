"""Which replica has seen which prompt starts: the prefix tree the prefix-aware router (:mod:`prunus.serve.ray_router`)
matches a new prompt against.

A prompt's text is cut into blocks of ``block`` characters; each full block is a node keyed by a chained hash of
the whole text up to and including it (the scheme of :mod:`prunus.runtime.prefix_cache`, over characters instead
of tokens), so one key names one exact prefix. A node records the replicas ("tenants") that were sent a prompt
through it, with when. :meth:`PrefixTree.match` walks a prompt's blocks down the tree and returns the characters
matched and the tenants of the deepest node reached; :meth:`insert` records a routed prompt. At most
``max_nodes`` nodes are kept, the least recently used go first (a parent is touched after its children, so a child
goes before its parent); a replica that leaves is removed from every node.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict

BLOCK_CHARS = 16
MAX_NODES = 200_000
MAX_PROMPT_CHARS = 1 << 16  # characters of a prompt that are matched and stored (its start is what matters)


def block_keys(text: str, block: int = BLOCK_CHARS) -> list[bytes]:
    """The chained hash of each full block of ``text`` (at most MAX_PROMPT_CHARS of it)."""
    data, keys, h = text[:MAX_PROMPT_CHARS], [], b""
    for i in range(len(data) // block):
        h = hashlib.blake2b(h + data[i * block:(i + 1) * block].encode("utf-8", "surrogatepass"),
                            digest_size=16).digest()
        keys.append(h)
    return keys


class PrefixTree:
    def __init__(self, block: int = BLOCK_CHARS, max_nodes: int = MAX_NODES):
        self.block, self.max_nodes = block, max_nodes
        self.nodes: OrderedDict[bytes, dict[str, float]] = OrderedDict()  # key -> {tenant: last used}
        self.chars: dict[str, int] = {}  # tenant -> characters of its prompts held in the tree

    def add_tenant(self, tenant: str) -> None:
        self.chars.setdefault(tenant, 0)

    def remove_tenant(self, tenant: str) -> None:
        self.chars.pop(tenant, None)
        for key in [k for k, tenants in self.nodes.items() if tenants.pop(tenant, None) is not None and not tenants]:
            del self.nodes[key]

    def match(self, text: str, tenants: list[str]) -> tuple[int, list[str]]:
        """(characters of ``text`` matched, those of ``tenants`` holding the longest match; [] when none)."""
        wanted, best, depth = set(tenants), [], 0
        for i, key in enumerate(block_keys(text, self.block)):
            holders = [t for t in self.nodes.get(key, ()) if t in wanted]
            if not holders:
                break
            best, depth = holders, (i + 1) * self.block
        return depth, best

    def smallest(self, tenants: list[str]) -> list[str]:
        """Those of ``tenants`` holding the fewest characters in the tree."""
        sizes = {t: self.chars.get(t, 0) for t in tenants}
        least = min(sizes.values(), default=0)
        return [t for t, size in sizes.items() if size == least]

    def insert(self, text: str, tenant: str) -> None:
        now, keys = time.monotonic(), block_keys(text, self.block)
        self.add_tenant(tenant)
        for key in keys:
            tenants = self.nodes.setdefault(key, {})
            if tenant not in tenants:
                self.chars[tenant] += self.block
            tenants[tenant] = now
        for key in reversed(keys):  # the parent ends most recent: children are evicted before it
            self.nodes.move_to_end(key)
        while len(self.nodes) > self.max_nodes:
            _, evicted = self.nodes.popitem(last=False)
            for t in evicted:
                if t in self.chars:
                    self.chars[t] -= self.block
