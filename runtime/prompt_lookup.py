"""Prompt-lookup drafting for speculative decoding: draft tokens copied from earlier in the sequence, no model.

The last ``n`` tokens (``n`` from ``max_ngram`` down to 1) are looked for earlier in the prompt and the text made
so far; the tokens that followed their most recent earlier occurrence are the draft. Code, quoted documents and
repetitive text continue the way they went before often enough that the target model, checking the draft in one
pass (:mod:`prunus.runtime.speculative`), accepts several tokens per step. A draft is a point mass: under sampling
the target accepts a drafted token with its own probability of it.
"""

from __future__ import annotations

MAX_NGRAM = 3


def lookup(seq: list[int], k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest tail n-gram of ``seq``
    (``max_ngram`` down to 1 tokens); empty when no tail occurred before."""
    n_seq = len(seq)
    for n in range(min(max_ngram, n_seq - 1), 0, -1):
        tail, last = seq[-n:], seq[-1]
        for start in range(n_seq - n - 1, -1, -1):  # an occurrence ending before the tail itself
            if seq[start + n - 1] == last and seq[start:start + n] == tail:
                return seq[start + n:start + n + k]
    return []


class PromptLookup:
    """A drafter (see :class:`prunus.runtime.speculative.Speculator`) with no state of its own."""

    name = "ngram"

    def __init__(self, max_ngram: int = MAX_NGRAM):
        self.max_ngram = max_ngram

    def propose(self, row: int, seq: list[int], k: int, sampling):
        return lookup(seq, k, self.max_ngram), None  # a point mass: no draft distribution

    def rollback(self, row: int, length: int) -> None:
        pass

    def release(self, row: int) -> None:
        pass

    def close(self) -> None:
        pass
