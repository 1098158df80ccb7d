"""Per-row logits processing for serving, and the log-probabilities handed back with each token.

A request's :class:`LogitsSettings` (``SamplingParams.logits``) changes its row of logits before the sampler
(:mod:`prunus.runtime.sampling`) applies temperature, top-k and top-p, in the order transformers' ``generate``
builds its processors:

1. ``logit_bias`` — ``SequenceBiasLogitsProcessor`` with one-token sequences: ``logits[t] += bias[t]``;
2. ``repetition_penalty`` — ``RepetitionPenaltyLogitsProcessor`` over the prompt and the tokens made so far:
   a seen token's logit is divided by the penalty when positive, multiplied by it when negative;
3. ``presence_penalty`` / ``frequency_penalty`` — OpenAI's definition over the tokens made so far:
   ``logits[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)``;
4. ``min_tokens`` — ``MinNewTokensLengthLogitsProcessor``: the request's stop tokens are at ``-inf`` until
   ``min_tokens`` tokens have been made (stop strings are still honoured);
5. ``grammar`` — structured outputs (:mod:`prunus.serve.structured_output`): every token the request's JSON
   schema or regex forbids next is at ``-inf``, stop tokens included until the grammar is complete.

Log-probabilities (``logprobs``) are the float32 log-softmax of these processed logits, before temperature,
top-k and top-p: with no bias or penalty they are the model's own next-token log-probabilities, the ones a
teacher-forced forward pass gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prunus.artifacts.errors import PrunusError

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
REPETITION_PENALTY = (0.01, 100.0)  # a tiny penalty divides a seen logit past float range (1e-300: inf); vLLM: > 0


@dataclass(frozen=True)
class LogitsSettings:
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias from -100 to 100)
    min_tokens: int = 0
    logprobs: int | None = None  # alternatives reported per token (0: the chosen one's only); None: none
    grammar: object = None  # a prunus.serve.structured_output.Grammar: the tokens allowed next, per row

    def check(self, vocab_size: int | None = None) -> "LogitsSettings":
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise PrunusError(f"{name}={getattr(self, name)!r} must be a number from -2 to 2")
        low, high = REPETITION_PENALTY
        if not low <= self.repetition_penalty <= high:
            raise PrunusError(f"repetition_penalty={self.repetition_penalty!r} must be a number from {low} to {high:g}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise PrunusError(f"logit_bias holds {len(self.logit_bias)} tokens; give at most {MAX_LOGIT_BIAS}")
        for token, bias in self.logit_bias:
            if vocab_size is not None and not 0 <= token < vocab_size:
                raise PrunusError(f"logit_bias names token {token}; token ids lie in [0, {vocab_size})")
            if not -100 <= bias <= 100:
                raise PrunusError(f"logit_bias of token {token} is {bias!r}; give a number from -100 to 100")
        if self.min_tokens < 0:
            raise PrunusError(f"min_tokens={self.min_tokens!r} must be a non-negative integer")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise PrunusError(f"logprobs={self.logprobs!r} must be an integer from 0 to {MAX_TOP_LOGPROBS}")
        return self

    @property
    def changes_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.grammar is not None)


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the ``top`` alternatives, (token id, log-probability), best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class SeenTokens:
    """A request's token history as the penalties read it, kept up to date a token at a time instead of rebuilt
    every step: which ids the prompt or the answer holds (``repetition_penalty``) and how often each id was
    generated (presence and frequency penalties)."""

    def __init__(self, prompt_ids: list[int], vocab: int, device):
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        if prompt_ids:
            self.seen[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.folded = 0  # generated tokens already counted

    def update(self, generated: list[int]) -> "SeenTokens":
        if len(generated) > self.folded:
            new = torch.tensor(generated[self.folded:], dtype=torch.long, device=self.counts.device)
            self.seen[new] = True
            self.counts.index_add_(0, new, torch.ones(len(new), device=self.counts.device))
            self.folded = len(generated)
        return self


def process_row(logits: torch.Tensor, settings: LogitsSettings, prompt_ids: list[int], generated: list[int],
                stop_ids: tuple[int, ...] = (), history: SeenTokens | None = None) -> torch.Tensor:
    """One row of logits (vocab,) processed as the module docstring says; a new float32 tensor. ``history``: the
    request's :class:`SeenTokens` (built here from the lists when not given)."""
    out = logits.float().clone()
    if settings.logit_bias:
        ids = torch.tensor([t for t, _ in settings.logit_bias], device=out.device)
        out.index_add_(0, ids, torch.tensor([b for _, b in settings.logit_bias], device=out.device))
    penalised = settings.repetition_penalty != 1.0 or settings.presence_penalty or settings.frequency_penalty
    if penalised:
        history = (history or SeenTokens(prompt_ids, out.numel(), out.device)).update(generated)
    if settings.repetition_penalty != 1.0:
        p = settings.repetition_penalty
        out = torch.where(history.seen, torch.where(out < 0, out * p, out / p), out)
    if (settings.presence_penalty or settings.frequency_penalty) and generated:
        counts = history.counts
        out -= settings.frequency_penalty * counts + settings.presence_penalty * (counts > 0)
    if len(generated) < settings.min_tokens and stop_ids:
        out[torch.tensor(stop_ids, device=out.device)] = -float("inf")
    return out


def _history(request, settings: LogitsSettings, vocab: int, device) -> SeenTokens | None:
    """The request's penalty state, made at its first step (None when no penalty asks for it)."""
    if settings.repetition_penalty == 1.0 and not (settings.presence_penalty or settings.frequency_penalty):
        return None
    history = getattr(request, "seen_tokens", None)
    if history is None:
        history = request.seen_tokens = SeenTokens(request.prompt_ids, vocab, device)
    return history


def process(requests, logits: torch.Tensor) -> torch.Tensor:
    """The batch's logits with each row processed by its request's settings (the same tensor when none asks)."""
    settings = [getattr(r.params, "logits", None) for r in requests]
    if not any(s is not None and s.changes_logits for s in settings):
        return logits
    vocab = logits.shape[-1]
    rows = [process_row(logits[i], s, r.prompt_ids, r.generated, r.stop_ids, _history(r, s, vocab, logits.device))
            if s is not None and s.changes_logits else logits[i].float()
            for i, (r, s) in enumerate(zip(requests, settings))]
    for row, r, s in zip(rows, requests, settings):
        if s is not None and s.grammar is not None:
            from .structured_output import mask_row
            mask_row(row, s.grammar, r)
    return torch.stack(rows)


def token_logprobs(requests, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob | None]:
    """Per row, the chosen token's log-probability and its request's top alternatives (None where not asked)."""
    out: list[TokenLogprob | None] = []
    for i, (r, token) in enumerate(zip(requests, tokens)):
        settings = getattr(r.params, "logits", None)
        if settings is None or settings.logprobs is None:
            out.append(None)
            continue
        row = torch.log_softmax(logits[i].float(), dim=-1)
        top = ()
        if settings.logprobs:
            values, ids = torch.topk(row, settings.logprobs)
            top = tuple(zip(ids.tolist(), values.tolist()))
        out.append(TokenLogprob(float(row[token]), top))
    return out
