"""What the :class:`prunus.runtime.speculative.Speculator` asks of a drafter, and several drafters as one.

A drafter ``offers`` the row's next step a list of ``(source, n)``: drafts it can make, named by their kind (its
acceptance and cost are learned per name) and how many tokens at most; ``propose`` makes ``k`` of one of them.
:class:`DraftSources` holds several drafters (an EAGLE head and prompt lookup): a row's step may take any one offer,
the one of the highest expected rate (:mod:`prunus.runtime.speculative_policy`), and every drafter sees every
rollback, so each keeps up with the text whoever drafted it.
"""

from __future__ import annotations

from pathlib import Path

LOOKUP = "ngram"  # --speculative's name for prompt lookup, alone or after a draft dir and "+"


def split_draft(draft) -> tuple[str | None, bool]:
    """(the draft dir or None, whether prompt lookup drafts too) of a ``--speculative`` value: ``ngram``, ``DIR``
    or ``DIR+ngram`` (a dir whose own name ends so is that dir)."""
    text = str(draft)
    if text == LOOKUP:
        return None, True
    if text.endswith("+" + LOOKUP) and not Path(text).is_dir():
        return text[:-len(LOOKUP) - 1], True
    return text, False


class Drafter:
    """The defaults: one offer of up to ``k`` tokens named :attr:`name`; nothing kept per row."""

    name = "draft"

    def offers(self, row: int, seq: list[int], k: int) -> list[tuple[str, int]]:
        return [(self.name, k)]

    def propose(self, row: int, seq: list[int], k: int, sampling):
        """(up to ``k`` draft tokens after ``seq``, their distributions (k, vocab) or None for point masses)."""
        raise NotImplementedError

    def rollback(self, row: int, length: int) -> None:
        pass

    def release(self, row: int) -> None:
        pass

    def close(self) -> None:
        pass


class DraftSources(Drafter):
    """Several drafters, their offers in the order given (the first a non-adaptive step takes)."""

    def __init__(self, drafters: list):
        self.drafters = list(drafters)
        self.name = "+".join(d.name for d in self.drafters)
        self.owner: dict[str, object] = {}

    def offers(self, row: int, seq: list[int], k: int) -> list[tuple[str, int]]:
        out = []
        for drafter in self.drafters:
            for source, n in drafter.offers(row, seq, k):
                self.owner[source] = drafter
                out.append((source, n))
        return out

    def propose(self, row: int, seq: list[int], k: int, sampling, source: str | None = None):
        drafter = self.owner[source] if source is not None else self.drafters[0]
        return drafter.propose(row, seq, k, sampling)

    def rollback(self, row: int, length: int) -> None:
        for drafter in self.drafters:
            drafter.rollback(row, length)

    def release(self, row: int) -> None:
        for drafter in self.drafters:
            drafter.release(row)

    def close(self) -> None:
        for drafter in self.drafters:
            drafter.close()
