"""Speculative decoding: a drafter proposes ``k`` tokens, the target model checks them all in one pass.

A step of one row (:meth:`Speculator.step`): the row holds its sequence but the last token; the drafter proposes
up to ``k`` tokens (:class:`DraftModel`: a smaller model dir with the same tokenizer, run step by step on its own
cache rows; :class:`prunus.runtime.prompt_lookup.PromptLookup`: tokens copied from earlier in the sequence); the
target appends the last token and the drafts in one ``verify`` pass, which gives its logits after each; the
accepted drafts and one token of the target's own come out, and both caches are truncated to the accepted tokens
(the rejected drafts' keys are never seen again).

* Greedy rows accept drafts while each equals the target's argmax, then take the target's argmax: the tokens of
  plain greedy decoding.
* Sampled rows use the rejection rule of Leviathan et al. and Chen et al. (2023): draft ``d`` drawn from ``q`` is
  accepted with probability ``min(1, p(d) / q(d))`` where ``p`` is the target's distribution (temperature, top-k,
  top-p as :func:`prunus.runtime.sampling.sample` applies them); at the first rejection the token is drawn from
  ``max(0, p - q)`` renormalised, and after ``k`` acceptances from the target's next ``p``. Every token is then
  distributed as the target's own sampling would draw it. A prompt-lookup draft is a point mass (``q(d) = 1``).

All draws use the request's own generator, so a seed gives the same tokens again (not the tokens of plain
sampling with that seed: the draws are different ones); a seeded sampled row drafts the same k at every step for
that (:func:`fixed_k`), where an unseeded one's k follows measured time. ``stats`` (live, in the engine's info)
counts steps, drafted and accepted tokens, the acceptance rate and, once a step of the target alone was timed, the
speedup.

Drafters: :class:`DraftModel`, prompt lookup, and an EAGLE draft head over the target's own hidden states
(:mod:`prunus.runtime.eagle_drafter`), alone or several as sources of one speculator
(:class:`prunus.runtime.drafter.DraftSources`: ``DIR+ngram``). :meth:`Speculator.step_rows` steps several rows at
once, their drafts checked in one ``verify_rows`` pass (the continuous batch, :mod:`prunus.serve.scheduler`). With
``adaptive`` each row drafts from the source and the number of tokens that make tokens fastest by its acceptance of
that source's drafts and the measured cost of the target's passes and of the source's drafting, and none where
nothing beats plain decoding (:mod:`prunus.runtime.speculative_policy`); otherwise the first source that offers
drafts ``k``. ``stats["sources"]`` counts drafted and accepted tokens by source.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from prunus.artifacts.errors import PrunusError
from prunus.models.generate import greedy_next

from .drafter import Drafter, DraftSources, split_draft
from .sampling import RowSampling, is_greedy, sampling_probs
from .speculative_policy import POOLED_DECAY, Acceptance, PassCosts, RowPolicy


class Speculator:
    def __init__(self, target, drafter, k: int, adaptive: bool = False):
        """``drafter``: a :class:`prunus.runtime.drafter.Drafter` or several as a
        :class:`prunus.runtime.drafter.DraftSources`; ``k``: the most tokens drafted per step; ``adaptive``: each
        row's own source and k from its acceptance and the measured cost of the target's passes, none where drafting
        would not beat plain decoding (:mod:`prunus.runtime.speculative_policy`)."""
        self.target, self.k, self.adaptive = target, k, adaptive
        self.drafter = drafter if isinstance(drafter, DraftSources) else DraftSources([drafter])
        self.stats = {"draft": self.drafter.name, "draft_tokens": k, "adaptive": adaptive, "steps": 0, "drafted": 0,
                      "accepted": 0, "acceptance_rate": 0.0, "tokens_per_step": 0.0, "speedup": None, "sources": {}}
        self._made, self._seconds, self._plain_s = 0, 0.0, None
        self.costs = PassCosts()
        self.pooled: dict[str, Acceptance] = {}  # every row's drafts by source: a new row's prior
        self.rows: dict[int, RowPolicy] = {}

    def release(self, row: int) -> None:
        self.rows.pop(row, None)
        self.drafter.release(row)

    def close(self) -> None:
        self.drafter.close()

    def step(self, row: int, seq: list[int], sampling: RowSampling, remaining: int) -> list[int]:
        """The next tokens of ``row`` (1 to k + 1 of them), whose cache holds ``seq`` but its last token;
        ``remaining``: tokens the request may still make."""
        return self.step_rows([row], [seq], [sampling], [remaining])[0]

    def step_rows(self, rows: list[int], seqs: list[list[int]], samplings: list[RowSampling],
                  remaining: list[int]) -> list[list[int]]:
        """:meth:`step` for several rows, their drafts checked in one pass of the target (``verify_rows``). Adaptive,
        a pass where any row is due to time the target alone (:meth:`RowPolicy.due`) drafts for none of them (but a
        seeded sampled row's fixed k)."""
        start = time.perf_counter()
        policies = [self.rows.get(row) or self.rows.setdefault(row, RowPolicy(self.k)) for row in rows]
        plain = self.adaptive and any(p.due() for p in policies)
        if plain:
            for p in policies:
                p.steps += 1
        cap = self.target.max_len - max(len(s) for s in seqs)  # drafts fit the pass's padded width
        drafted, tokens = [], len(rows)
        for policy, row, seq, sampling, left in zip(policies, rows, seqs, samplings, remaining):
            room = min(left - 1, cap if not plain or fixed_k(sampling) else 0)
            drafted.append(self._draft(policy, row, seq, sampling, room, len(rows), tokens))
            tokens += len(drafted[-1][1])
        checked = time.perf_counter()
        pieces = [[seq[-1]] + d for seq, (_, d, _) in zip(seqs, drafted)]
        if len(rows) == 1:
            logits_rows = [self.target.verify(rows[0], pieces[0])]
        else:
            logits_rows = self.target.verify_rows(rows, pieces)
        done = time.perf_counter()
        self.costs.observe(tokens, done - checked)
        per_token = (done - start) / tokens  # a row's share: its tokens in the pass
        if tokens == len(rows):  # the target alone: plain decoding's cost a row at this many rows
            self._plain_s = per_token
        return [self._accept(policy, row, seq, sampling, d, logits, per_token)
                for policy, row, seq, sampling, d, logits in zip(policies, rows, seqs, samplings, drafted, logits_rows)]

    def _accept(self, policy: RowPolicy, row: int, seq: list[int], sampling: RowSampling, drafted, logits,
                per_token: float) -> list[int]:
        """The row's tokens of this step: its accepted drafts and the target's own after them; the caches kept to
        them, the counts of the draft's source updated."""
        source, drafts, q = drafted
        if is_greedy(sampling):
            accepted, extra = accept_greedy(drafts, logits)
        else:
            accepted, extra = accept_sampled(drafts, q, sampling_probs(logits, sampling).cpu(), sampling.generator)
        self.target.truncate(row, len(seq) + accepted)
        self.drafter.rollback(row, len(seq) + accepted)
        if source is not None:
            policy.acceptance(source).record(len(drafts), accepted, policy.steps)
            pooled = self.pooled.get(source) or self.pooled.setdefault(source, Acceptance(self.k, POOLED_DECAY))
            pooled.record(len(drafts), accepted, self.stats["steps"])
            counts = self.stats["sources"].setdefault(source, {"drafted": 0, "accepted": 0})
            counts["drafted"] += len(drafts)
            counts["accepted"] += accepted
        self._count(len(drafts), accepted, per_token * (1 + len(drafts)))
        return drafts[:accepted] + [extra]

    def _rate(self, policy: RowPolicy, n: int, tokens: int, source: str | None, k: int) -> float | None:
        """Tokens per second a row of a pass of ``n`` rows (``tokens`` checked so far) makes drafting ``k`` of
        ``source``: its expected tokens over its share of a plain pass, the ``k`` more the pass checks and their
        drafting."""
        plain = self.costs.at(n)
        if plain is None:
            return None
        if not k:
            return n / plain
        before, after = self.costs.at(tokens), self.costs.at(tokens + k)
        if before is None:  # the pass is already longer than any measured: no row adds to it to measure more
            return 0.0
        if after is None:
            return None
        seconds = plain / n + max(0.0, after - before) + k * self.costs.draft_s.get(source, 0.0)
        return (1 + policy.acceptance(source).expected(k, self.pooled.get(source))) / seconds

    def _draft(self, policy: RowPolicy, row: int, seq: list[int], sampling: RowSampling, room: int, n: int,
               tokens: int):
        """(source, drafts, their distributions or None) for one row: up to k tokens, fewer near the end of its
        request or the cache, the row's own source and k (``policy``) when adaptive."""
        k = max(0, min(self.k, room))
        offers = self.drafter.offers(row, seq, k) if k else []
        if self.adaptive and k and not fixed_k(sampling):
            source, k = policy.choose(offers, lambda src, j: self._rate(policy, n, tokens, src, j))
        else:
            source, k = (offers[0][0], min(k, offers[0][1])) if offers else (None, 0)
        if not k:
            return None, [], None
        start = time.perf_counter()
        drafts, q = self.drafter.propose(row, seq, k, None if is_greedy(sampling) else sampling, source)
        if drafts:
            self.costs.observe_draft(source, len(drafts), time.perf_counter() - start)
        return source, drafts, q

    def _count(self, drafted: int, accepted: int, seconds: float) -> None:
        s = self.stats
        s["steps"] += 1
        s["drafted"] += drafted
        s["accepted"] += accepted
        self._made += accepted + 1
        self._seconds += seconds
        s["acceptance_rate"] = round(s["accepted"] / s["drafted"], 4) if s["drafted"] else 0.0
        s["tokens_per_step"] = round(self._made / s["steps"], 3)
        if self._plain_s is not None:  # tokens per second of every step, over plain decoding's (last measured)
            s["speedup"] = round(self._made / self._seconds * self._plain_s, 3)


def fixed_k(sampling: RowSampling) -> bool:
    """A sampled row with the request's own seed drafts k tokens at every step, timed or not: the adaptive choice
    follows measured time, and its draws, so its tokens, would change from run to run (greedy tokens never do)."""
    return sampling.seeded and not is_greedy(sampling)


def accept_greedy(drafts: list[int], logits: torch.Tensor) -> tuple[int, int]:
    """(drafts accepted, the target's token after them): drafts are kept while each is the target's argmax."""
    best = greedy_next(logits).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return n, best[n]


def accept_sampled(drafts: list[int], q: torch.Tensor | None, p: torch.Tensor,
                   generator: torch.Generator) -> tuple[int, int]:
    """The rejection rule: ``p`` (k + 1, vocab) the target's probabilities after each position, ``q`` (k, vocab)
    the draft's (None: point masses at the drafts). (drafts accepted, the token drawn after them)."""
    for i, d in enumerate(drafts):
        q_d = float(q[i, d]) if q is not None else 1.0
        if float(torch.rand((), generator=generator)) * q_d < float(p[i, d]):
            continue
        if q is not None:
            residual = (p[i] - q[i]).clamp_min(0)
        else:
            residual = p[i].clone()
            residual[d] = 0
        if not float(residual.sum()) > 0:  # p == q up to rounding: any draw from p is exact
            residual = p[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator))


class DraftModel(Drafter):
    """A draft model dir on its own torch backend, one cache row per target row; each row remembers how much of
    its request's sequence it holds and catches up on what it has not seen (prompt, plain steps) before drafting."""

    name = "model"

    def __init__(self, backend):
        self.backend = backend
        self.held: dict[int, int] = {}

    def _catch_up(self, row: int, seq: list[int]) -> torch.Tensor:
        held = self.held.get(row, 0)
        if held == 0:
            return self.backend.prefill([row], [seq])[0]
        chunk = self.backend.prefill_chunk or len(seq)
        for start in range(held, len(seq), chunk):
            logits = self.backend.extend([row], [seq[start:start + chunk]])
        return logits[0]

    def propose(self, row: int, seq: list[int], k: int, sampling: RowSampling | None):
        logits = self._catch_up(row, seq)
        drafts, qs = [], []
        for i in range(k):
            if sampling is None:
                token = int(greedy_next(logits[None])[0])
            else:
                q = sampling_probs(logits[None], sampling)[0].cpu()
                token = int(torch.multinomial(q, 1, generator=sampling.generator))
                qs.append(q)
            drafts.append(token)
            if i < k - 1:
                logits = self.backend.decode([row], [token])[0]
        self.held[row] = len(seq) + k - 1
        return drafts, (torch.stack(qs) if qs else None)

    def rollback(self, row: int, length: int) -> None:
        if row not in self.held:  # another source drafted for a row this draft never read
            return
        held = min(self.held[row], length)
        self.held[row] = held
        self.backend.truncate(row, held)

    def release(self, row: int) -> None:
        self.held.pop(row, None)
        self.backend.release(row)

    def close(self) -> None:
        self.backend.close()


def load_speculator(target_path, backend, draft, k: int, adaptive: bool = True) -> Speculator:
    """The speculator ``Engine.load(draft=..., draft_tokens=k)`` asks for over the loaded target ``backend``: prompt
    lookup ("ngram"), an EAGLE draft dir (:mod:`prunus.runtime.eagle_drafter`) or a draft model dir, or a dir and
    prompt lookup together ("DIR+ngram": each step of a row takes the offer of the highest expected rate)."""
    if not backend.capabilities.verify:
        raise PrunusError(f"draft: the {backend.name} backend cannot check draft tokens; drop --speculative")
    from .eagle_drafter import is_eagle_dir, load_eagle_drafter
    from .prompt_lookup import PromptLookup

    folder, lookup = split_draft(draft)
    drafters = []
    if folder is not None and is_eagle_dir(Path(folder)):
        drafters.append(load_eagle_drafter(Path(folder), backend))
    elif folder is not None:
        drafters.append(load_draft_model(Path(target_path), Path(folder), backend))
    if lookup:
        drafters.append(PromptLookup())
    return Speculator(backend, DraftSources(drafters), k, adaptive)


def load_draft_model(target: Path, draft: Path, backend) -> DraftModel:
    """A draft model dir beside the target's: a transformer model dir with the same tokenizer and vocabulary, and
    the context the engine serves; one PrunusError line naming both dirs otherwise."""
    from prunus.models import load_model
    from prunus.models.model_dir import read_config

    from .torch import TorchBackend

    if not (draft / "config.json").is_file():
        raise PrunusError(f"--speculative {draft}: not a model dir (no config.json); give a prunus model dir or ngram")
    draft_cfg, draft_config = read_config(draft)
    if "export" in draft_config:
        raise PrunusError(f"--speculative {draft}: an export dir; the draft must be a prunus model dir")
    target_cfg, target_config = read_config(target)
    why = tokenizer_difference(target, target_config, target_cfg, draft, draft_config, draft_cfg)
    if why:
        raise PrunusError(f"draft model {draft} and target {target} have different tokenizers ({why}); a draft "
                          "must share the target's tokenizer")
    if draft_cfg.max_seq_len < backend.max_len:
        raise PrunusError(f"draft model {draft} holds {draft_cfg.max_seq_len} tokens, below the {backend.max_len} "
                          f"the target {target} serves; lower max_len (--max-len)")
    model = load_model(draft, device=backend.device)
    return DraftModel(TorchBackend(model, backend.n_slots, backend.max_len, prefill_chunk=backend.prefill_chunk))


def _digest(path: Path) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tokenizer_difference(target: Path, target_config: dict, target_cfg, draft: Path, draft_config: dict,
                         draft_cfg) -> str | None:
    """Why two model dirs' tokenizers differ, in a few words, or None: the spec in config.json, the bytes of
    tokenizer.json, the vocabulary size."""
    if target_config.get("tokenizer") != draft_config.get("tokenizer"):
        return "config.json tokenizer entries differ"
    files = [p / "tokenizer.json" for p in (target, draft)]
    if any(f.exists() for f in files):
        if not all(f.is_file() for f in files) or _digest(files[0]) != _digest(files[1]):
            return "tokenizer.json differs"
    if target_cfg.vocab_size != draft_cfg.vocab_size:
        return f"vocab_size {target_cfg.vocab_size} and {draft_cfg.vocab_size}"
    return None
