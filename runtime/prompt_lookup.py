"""Prompt-lookup drafting for speculative decoding: draft tokens copied from earlier in the sequence, no model.

The last ``n`` tokens (``n`` from ``max_ngram`` down to 1) are looked for earlier in the prompt and the text made
so far; the tokens that followed their most recent earlier occurrence are the draft. Code, quoted documents and
repetitive text continue the way they went before often enough that the target model, checking the draft in one
pass (:mod:`prunus.runtime.speculative`), accepts several tokens per step. A draft is a point mass: under sampling
the target accepts a drafted token with its own probability of it.
"""

from __future__ import annotations

from .drafter import Drafter

MAX_NGRAM = 3


def lookup(seq: list[int], k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest tail n-gram of ``seq``
    (``max_ngram`` down to 1 tokens); empty when no tail occurred before."""
    return match(seq, k, max_ngram)[1]


def match(seq: list[int], k: int, max_ngram: int = MAX_NGRAM) -> tuple[int, list[int]]:
    """(n, the tokens :func:`lookup` drafts): ``n`` the length of the tail that matched (0: none did)."""
    n_seq = len(seq)
    for n in range(min(max_ngram, n_seq - 1), 0, -1):
        tail, last = seq[-n:], seq[-1]
        for start in range(n_seq - n - 1, -1, -1):  # an occurrence ending before the tail itself
            if seq[start + n - 1] == last and seq[start:start + n] == tail:
                return n, seq[start + n:start + n + k]  # at least one token: the occurrence ends before the tail
    return 0, []


class NgramIndex:
    """Where each n-gram (1 to ``max_ngram`` tokens) of a row's sequence last ended, over the ends up to
    ``covered``, grown by the tokens a step adds: a lookup costs a few dict reads whatever the sequence's length,
    where :func:`match` scans it (1.5 ms a row at 8,000 tokens, every step of every row that may draft by lookup)."""

    HEAD = 8  # leading tokens kept to tell the row's sequence from another request's

    def __init__(self, seq: list[int]):
        self.ends: dict[tuple[int, ...], int] = {}
        self.covered, self.head = 0, tuple(seq[:self.HEAD])

    def fits(self, seq: list[int]) -> bool:
        return self.covered < len(seq) and tuple(seq[:self.HEAD]) == self.head

    def match(self, seq: list[int], k: int, max_ngram: int) -> tuple[int, list[int]]:
        """:func:`match`'s answer: occurrences ending before the tail (ends up to ``len(seq) - 1``), the latest."""
        for end in range(self.covered + 1, len(seq)):
            for n in range(1, min(max_ngram, end) + 1):
                self.ends[tuple(seq[end - n:end])] = end
        self.covered = max(self.covered, len(seq) - 1)
        for n in range(min(max_ngram, len(seq) - 1), 0, -1):
            end = self.ends.get(tuple(seq[-n:]))
            if end is not None:
                return n, seq[end:end + k]
        return 0, []


class PromptLookup(Drafter):
    """A drafter (see :class:`prunus.runtime.speculative.Speculator`) keeping each row's :class:`NgramIndex` and
    last lookup. Its offers are named by the length of the tail that matched (``ngram3``, ``ngram2``, ``ngram1``), so
    that the policy learns how often each kind of match is right: a three-token match is, more often than a one-token
    one."""

    name = "ngram"

    def __init__(self, max_ngram: int = MAX_NGRAM):
        self.max_ngram = max_ngram
        self.index: dict[int, NgramIndex] = {}
        self.found: dict[int, tuple[int, list[int]]] = {}  # the row's last lookup: (its length of seq, the tokens)

    def _match(self, row: int, seq: list[int], k: int) -> tuple[int, list[int]]:
        index = self.index.get(row)
        if index is None or not index.fits(seq):  # a new request on the row (or a shorter sequence): afresh
            index = self.index[row] = NgramIndex(seq)
        return index.match(seq, k, self.max_ngram)

    def offers(self, row: int, seq: list[int], k: int) -> list[tuple[str, int]]:
        n, found = self._match(row, seq, k)
        self.found[row] = len(seq), found
        return [(f"ngram{n}", len(found))] if n else []

    def propose(self, row: int, seq: list[int], k: int, sampling):
        length, found = self.found.pop(row, (None, []))
        if length != len(seq) or len(found) < k:
            found = self._match(row, seq, k)[1]
        return found[:k], None  # a point mass: no draft distribution

    def release(self, row: int) -> None:
        self.found.pop(row, None)
        self.index.pop(row, None)
