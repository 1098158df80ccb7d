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
sampling with that seed: the draws are different ones). ``stats`` (live, in the engine's info) counts steps,
drafted and accepted tokens, the acceptance rate and, once a step of the target alone was timed, the speedup.

Drafters: :class:`DraftModel`, prompt lookup, and an EAGLE draft head over the target's own hidden states
(:mod:`prunus.runtime.eagle_drafter`). :meth:`Speculator.step_rows` steps several rows at once, their drafts checked
in one ``verify_rows`` pass (the continuous batch, :mod:`prunus.serve.scheduler`). With ``adaptive`` each row drafts
the number of tokens whose steps it measured making tokens fastest, and none for a while where even that measured
slower than plain decoding (:class:`RowPolicy`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from prunus.artifacts.errors import PrunusError
from prunus.models.generate import greedy_next

from .sampling import RowSampling, is_greedy, sampling_probs


CALIBRATE_EVERY = 64  # a row's steps between steps that time the target alone (no row of the pass drafts); first: 2
TRIES = 4  # steps a row drafts each k before it decides whether one more drafted token is worth trying
KEEP = 0.8  # a k whose drafts are accepted at least this often: one more is tried, and the most so tried is kept
OFF_STEPS = 64  # steps a switched-off row decodes plainly before it tries its fastest k again; doubled each time
MAX_OFF_STEPS = 1024
LOSING = 0.95  # a row whose fastest k measured below this speedup decodes plainly
DECAY = 0.9  # each step's weight against the row's earlier steps of the same k


class RowPolicy:
    """One row's measured steps per number of drafted tokens k: tokens made and seconds (recent steps weigh more),
    and whether it is switched off (speculation lost on it). A row drafts one token :data:`TRIES` times, then one
    more while the last k made tokens faster than the k before it (k = 1: faster than plain decoding), or at once
    while its drafts were accepted at least :data:`KEEP` of the time; then the k whose steps made tokens fastest
    (the top one where the climb went on by acceptance: the same k whatever the clock said), as long as that beats
    plain decoding. The cost of a verify pass over k + 1 tokens, not the acceptance alone, decides: on a CPU it
    grows with k, and at batch with every row's tokens, so the climb starts at the cheapest k. A row switched off
    measures only that k again, after :data:`OFF_STEPS` plain steps, twice as many after each loss. A row's seconds
    are its share of its passes (the pass's time by the tokens it checked there), set against a row's share of a
    plain pass of as many rows (:class:`Speculator`): a row that adds drafts to a batch pays for them, not its
    neighbours."""

    def __init__(self):
        self.steps, self.off_until, self.off_steps, self.retry = 0, -1, OFF_STEPS, None
        self.by_k: dict[int, list[float]] = {}  # k -> [steps, tokens made, seconds, drafted, accepted]

    def _rate(self, k: int) -> float:
        tried = self.by_k.get(k)
        return tried[1] / tried[2] if tried and tried[2] > 0 else 0.0

    def due(self) -> bool:
        """Whether the row's next step times the target alone: its 2nd, then every :data:`CALIBRATE_EVERY`-th."""
        return (self.steps + 1) % CALIBRATE_EVERY == 2

    def k(self, k_max: int, plain_s: float | None) -> int:
        """Drafted tokens for the row's next step: 0 while switched off; else one still being tried, or the fastest
        measured; ``plain_s``: plain decoding's seconds a token in a pass of as many rows (None: not measured)."""
        self.steps += 1
        if self.steps < self.off_until:
            return 0
        floor, top = (1 / plain_s if plain_s else 0.0), None  # plain decoding's tokens per second
        for k in range(1, k_max + 1) if self.retry is None else [min(self.retry, k_max)]:
            tried = self.by_k.get(k)
            kept = tried is not None and 0 < KEEP * tried[3] <= tried[4]  # one more is worth trying at once
            if tried is None or tried[0] < TRIES and not (kept and k < k_max):
                return k
            top = k if kept else None
            if top is None and self._rate(k) <= floor:
                break  # no faster than one fewer: more drafted tokens would cost more still
            floor = max(floor, self._rate(k))
        best = top if top is not None else max(self.by_k, key=self._rate)
        if plain_s and self._rate(best) * plain_s < LOSING:  # off; then only the fastest k is measured again
            self.off_until, self.by_k, self.retry = self.steps + self.off_steps, {best: [0, 0.0, 0.0, 0, 0]}, best
            self.off_steps = min(2 * self.off_steps, MAX_OFF_STEPS)
            return 0
        return min(best, k_max)  # fewer near the end of a request or the cache

    def record(self, drafted: int, accepted: int, seconds: float) -> None:
        if drafted:
            tried = self.by_k.setdefault(drafted, [0, 0.0, 0.0, 0, 0])
            tried[0] += 1
            tried[1] = DECAY * tried[1] + accepted + 1
            tried[2] = DECAY * tried[2] + seconds
            tried[3] += drafted
            tried[4] += accepted


class Speculator:
    def __init__(self, target, drafter, k: int, adaptive: bool = False):
        """``k``: the most tokens drafted per step; ``adaptive``: each row's own k from its acceptance, and no
        drafting on a row where speculation measured slower than plain decoding (:class:`RowPolicy`)."""
        self.target, self.drafter, self.k, self.adaptive = target, drafter, k, adaptive
        self.stats = {"draft": drafter.name, "draft_tokens": k, "adaptive": adaptive, "steps": 0, "drafted": 0,
                      "accepted": 0, "acceptance_rate": 0.0, "tokens_per_step": 0.0, "speedup": None}
        self._made, self._seconds, self._plain_s = 0, 0.0, None
        self._plain: dict[int, float] = {}  # rows in a pass -> seconds a row of a pass that drafted nothing
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
        a pass where any row is due to time the target alone (:meth:`RowPolicy.due`) drafts for none of them: it
        times plain decoding at this many rows, what each row's speculation is measured against (a plain row beside
        drafting ones would time their verify work, not plain decoding)."""
        start = time.perf_counter()
        policies = [self.rows.setdefault(row, RowPolicy()) for row in rows]
        plain = self.adaptive and any(p.due() for p in policies)
        if plain:
            for p in policies:
                p.steps += 1
        cap = 0 if plain else self.target.max_len - max(len(s) for s in seqs)  # drafts fit the pass's padded width
        plain_s = self._plain_at(len(rows))
        drafted = [self._draft(policy, row, seq, sampling, min(left - 1, cap), plain_s)
                   for policy, row, seq, sampling, left in zip(policies, rows, seqs, samplings, remaining)]
        pieces = [[seq[-1]] + d for seq, (d, _) in zip(seqs, drafted)]
        if len(rows) == 1:
            logits_rows = [self.target.verify(rows[0], pieces[0])]
        else:
            logits_rows = self.target.verify_rows(rows, pieces)
        per_token = (time.perf_counter() - start) / sum(map(len, pieces))  # a row's share: its tokens in the pass
        if not any(d for d, _ in drafted):  # the target alone: plain decoding's cost a row at this many rows
            old = self._plain.get(len(rows))
            self._plain_s = self._plain[len(rows)] = per_token if old is None else 0.8 * old + 0.2 * per_token
        out = []
        for row, seq, sampling, (drafts, q), logits in zip(rows, seqs, samplings, drafted, logits_rows):
            seconds = per_token * (1 + len(drafts))
            if is_greedy(sampling):
                accepted, extra = accept_greedy(drafts, logits)
            else:
                accepted, extra = accept_sampled(drafts, q, sampling_probs(logits, sampling).cpu(), sampling.generator)
            self.target.truncate(row, len(seq) + accepted)
            self.drafter.rollback(row, len(seq) + accepted)
            self.rows[row].record(len(drafts), accepted, seconds)
            self._count(len(drafts), accepted, seconds)
            out.append(drafts[:accepted] + [extra])
        return out

    def _plain_at(self, n: int) -> float | None:
        """Plain decoding's seconds a row in a pass of ``n`` rows: as measured at ``n``, else at the nearest count."""
        if not self._plain:
            return None
        return self._plain[min(self._plain, key=lambda m: (abs(m - n), m))]

    def _draft(self, policy: RowPolicy, row: int, seq: list[int], sampling: RowSampling, room: int,
               plain_s: float | None):
        """(drafts, their distributions or None) for one row: up to k tokens, fewer near the end of its request or
        the cache, the row's own k (``policy``) when adaptive."""
        k = max(0, min(self.k, room))
        if self.adaptive and k:
            k = policy.k(k, plain_s)
        if not k:
            return [], None
        return self.drafter.propose(row, seq, k, None if is_greedy(sampling) else sampling)

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


class DraftModel:
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
        held = min(self.held.get(row, 0), length)
        self.held[row] = held
        self.backend.truncate(row, held)

    def release(self, row: int) -> None:
        self.held.pop(row, None)
        self.backend.release(row)

    def close(self) -> None:
        self.backend.close()


def load_speculator(target_path, backend, draft, k: int, adaptive: bool = True) -> Speculator:
    """The speculator ``Engine.load(draft=..., draft_tokens=k)`` asks for over the loaded target ``backend``: prompt
    lookup ("ngram"), an EAGLE draft dir (:mod:`prunus.runtime.eagle_drafter`) or a draft model dir."""
    if not backend.capabilities.verify:
        raise PrunusError(f"draft: the {backend.name} backend cannot check draft tokens; drop --speculative")
    if str(draft) == "ngram":
        from .prompt_lookup import PromptLookup

        return Speculator(backend, PromptLookup(), k, adaptive)
    from .eagle_drafter import is_eagle_dir, load_eagle_drafter

    if is_eagle_dir(Path(draft)):
        return Speculator(backend, load_eagle_drafter(Path(draft), backend), k, adaptive)
    return Speculator(backend, load_draft_model(Path(target_path), Path(draft), backend), k, adaptive)


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
