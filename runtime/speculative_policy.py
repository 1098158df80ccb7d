"""How many tokens a row drafts: the rate each choice would make, from the row's acceptance and the measured cost of
the target's passes (:class:`prunus.runtime.speculative.Speculator` asks at every step).

Drafting ``k`` tokens makes ``1 + E(k)`` tokens a step, ``E(k) = a1 + a1 a2 + ... + a1 ... ak`` where ``ai`` is how
often the row's i-th drafted token is accepted once those before it were (:class:`Acceptance`: decayed counts, the
row's own over a prior of every row's). It costs the row its share of a plain pass of as many rows, ``c(n) / n``,
the ``k`` more tokens the pass checks, ``c(T + k) - c(T)``, and ``k`` drafted tokens at the drafter's measured cost
(:class:`PassCosts`: ``c(T)`` the seconds of the target's passes by the tokens they checked, the median of recent
ones per count, interpolated between counts). With several draft sources (an EAGLE head and prompt lookup,
:class:`prunus.runtime.drafter.DraftSources`) each source's acceptance and drafting cost are its own: a
prompt-lookup match costs next to nothing, and how often it is right depends on the length of the match (``ngram3``
.. ``ngram1``). The row drafts the source and ``k`` of the highest rate among those offered this step, or none where
nothing beats plain decoding by :data:`MARGIN`. So a CPU, where checking more tokens costs more (and at batch, with
every row's tokens), drafts where acceptance pays for it, and the choice moves with the row's acceptance as its text
changes; a verify pass's cost is measured over every pass, not one row's few noisy steps.

A pass of one token more than any measured is predicted on the line through the last two measured counts (and so
tried where that pays, then measured); beyond it nothing is predicted, so a row drafts more only once the count
before was measured. A pass one token longer than the only one measured is tried to measure it. A source that does
not pay (for a row decoding plainly, or beside the source it drafts from) drafts one token now and then to measure
its acceptance again (after :data:`EXPLORE_STEPS` steps offered, twice as many each time it still loses, up to
:data:`MAX_EXPLORE_STEPS`): a source judged on one unlucky draft is not lost to the row. Every
:data:`CALIBRATE_EVERY`-th step of a row (the 2nd first) is a pass where no row drafts: it times plain decoding at
this many rows.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque

CALIBRATE_EVERY = 64  # a row's steps between passes that time the target alone (no row of the pass drafts); first: 2
DECAY = 0.95  # what a row's drafts count for one step later
POOLED_DECAY = 0.999  # the same for every row's drafts of a source: the prior a row's own counts fade back to
PRIOR = 2.0  # drafts' worth of every row's acceptance in a row's estimate (a new row starts from it)
MARGIN = 1.02  # drafting must beat plain decoding's rate by this much
EXPLORE_STEPS = 32  # steps a row decodes plainly before it drafts one token again; doubled while it still loses
MAX_EXPLORE_STEPS = 1024
COST_SAMPLES = 15  # a pass size's cost, a source's per token: the median of its last timings (a stall moves one)


class Acceptance:
    """Counts, per position i, of drafted tokens judged there (those before all accepted) and accepted, fading by
    :data:`DECAY` a step: what a row drafted long ago (before it decoded plainly a while) counts for little, and its
    estimate returns to the prior, every row's counts of the source fading by :data:`POOLED_DECAY` (an EAGLE draft
    right 80% of the time is expected to be so again, not judged a coin's toss, when a row has not drafted with it
    for a while)."""

    def __init__(self, k_max: int, decay: float = DECAY):
        self.judged, self.taken, self.step, self.decay = [0.0] * k_max, [0.0] * k_max, 0, decay

    def record(self, drafted: int, accepted: int, step: int) -> None:
        """The outcome of ``drafted`` tokens at ``step`` (a count of steps that only grows)."""
        fade, self.step = self.decay ** max(0, step - self.step), step
        self.judged = [fade * j for j in self.judged]
        self.taken = [fade * t for t in self.taken]
        for i in range(min(drafted, accepted + 1, len(self.judged))):
            self.judged[i] += 1
            self.taken[i] += i < accepted

    def rate(self, i: int, prior: "Acceptance | None" = None) -> float:
        """How often a drafted token at position ``i`` is accepted: the counts over ``PRIOR`` of ``prior``'s (0.5
        where nothing was judged there)."""
        base = prior.rate(i) if prior is not None and prior.judged[i] > 0 else 0.5
        return (self.taken[i] + PRIOR * base) / (self.judged[i] + PRIOR)

    def expected(self, k: int, prior: "Acceptance | None" = None) -> float:
        """Tokens accepted on average of ``k`` drafted: a1 + a1 a2 + ... ."""
        total, chain = 0.0, 1.0
        for i in range(min(k, len(self.judged))):
            chain *= self.rate(i, prior)
            total += chain
        return total


class PassCosts:
    """Seconds of the target's passes by the tokens they checked (the median of recent timings per count), and of a
    drafted token by the draft's source."""

    def __init__(self):
        self.by_tokens: dict[int, float] = {}  # the median of each count's recent timings
        self.bounded: dict[int, float] = {}  # the same, never above a larger count's
        self.measured: list[int] = []  # the counts timed, ascending
        self.samples: dict[int, deque] = {}
        self.draft_s: dict[str, float] = {}
        self.draft_samples: dict[str, deque] = {}

    def observe(self, tokens: int, seconds: float) -> None:
        recent = self.samples.setdefault(tokens, deque(maxlen=COST_SAMPLES))
        recent.append(seconds)
        self.by_tokens[tokens] = statistics.median(recent)
        self.measured = sorted(self.by_tokens)  # and each count's cost bounded by the larger counts' (see at)
        low, self.bounded = float("inf"), {}
        for t in reversed(self.measured):
            low = self.bounded[t] = min(low, self.by_tokens[t])

    def observe_draft(self, source: str, drafted: int, seconds: float) -> None:
        """``drafted`` tokens of ``source`` took ``seconds`` to make: its cost per token, the median of its recent
        proposals (one slow proposal, a first pass or a stall, moves one sample only)."""
        recent = self.draft_samples.setdefault(source, deque(maxlen=COST_SAMPLES))
        recent.append(seconds / drafted)
        self.draft_s[source] = statistics.median(recent)

    def at(self, tokens: int) -> float | None:
        """A pass of ``tokens``: as measured, else on the line through the nearest measured counts (one each side,
        or the two nearest); above the largest measured count only for the next count, so that larger passes are
        measured one count at a time, not predicted from far below. None where it cannot say. A count's cost is
        never above a larger measured count's (a pass of fewer tokens does not cost more: a rarely measured count
        with a slow sample is bounded by the counts above it)."""
        if tokens in self.bounded:
            return self.bounded[tokens]
        measured = self.measured
        if len(measured) < 2 or tokens > measured[-1] + 1:
            return None
        i = bisect.bisect(measured, tokens)  # the first measured count above ``tokens``
        a, b = (measured[i - 1], measured[i]) if 0 < i < len(measured) else (
            (measured[-2], measured[-1]) if i else (measured[0], measured[1]))
        ca, cb = self.bounded[a], self.bounded[b]
        line = ca + (cb - ca) * (tokens - a) / (b - a)
        return line if line > 0 else None  # a line steep enough to reach zero below the counts measured says nothing


class RowPolicy:
    """One row's acceptance per draft source, its step count and, per source, when it next drafts one token to
    measure that source's acceptance again."""

    def __init__(self, k_max: int):
        self.k_max, self.steps, self.by_source = k_max, 0, {}
        self.explore: dict[str, int] = {}  # steps between tries of a source that does not pay, doubled each time
        self.next_try: dict[str, int] = {}

    def acceptance(self, source: str) -> Acceptance:
        return self.by_source.get(source) or self.by_source.setdefault(source, Acceptance(self.k_max))

    def due(self) -> bool:
        """Whether the row's next step times the target alone: its 2nd, then every :data:`CALIBRATE_EVERY`-th."""
        return (self.steps + 1) % CALIBRATE_EVERY == 2

    def choose(self, offers: list[tuple[str, int]], rate) -> tuple[str | None, int]:
        """(source, tokens) the row drafts at its next step, of ``offers`` ((source, the most it drafts) each);
        ``rate(source, k)``: the tokens per second drafting ``k`` of ``source`` would make, ``rate(None, 0)`` plain
        decoding's (None: a pass of that size has no measured or predicted cost yet)."""
        self.steps += 1
        if not offers:
            return None, 0
        plain = rate(None, 0)
        if plain is None:
            return offers[0][0], 1  # nothing timed yet: draft one (the row's 2nd step times the target alone)
        best, best_rate = (None, 0), plain * MARGIN
        for source, most in offers:
            for k in range(1, most + 1):
                r = rate(source, k)
                if r is None:
                    if k == 1:
                        return source, 1  # a pass one token longer never timed: measure it
                    break  # larger passes are measured one count at a time
                if r > best_rate:
                    best, best_rate = (source, k), r
        if best[1]:
            self.explore.pop(best[0], None)
            self.next_try.pop(best[0], None)
        return self._explore([source for source, _ in offers if source != best[0]]) or best

    def _explore(self, losing: list[str]) -> tuple[str, int] | None:
        """One token of a source that does not pay now and then (after :data:`EXPLORE_STEPS` steps offered without
        paying, twice as many after each try that still loses): a source judged on a few drafts is measured again."""
        for source in losing:
            if source not in self.next_try:
                self.explore[source] = EXPLORE_STEPS
                self.next_try[source] = self.steps + EXPLORE_STEPS
            elif self.steps >= self.next_try[source]:
                self.explore[source] = min(2 * self.explore[source], MAX_EXPLORE_STEPS)
                self.next_try[source] = self.steps + self.explore[source]
                return source, 1
        return None
