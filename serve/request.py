"""One generation request: its sampling settings, its tokens as they come, its result.

The scheduler thread feeds a request token by token (:meth:`Request.add_token`);
the caller's thread reads :class:`StreamToken` events from ``request.events`` and
ends with the :class:`GenerationResult`. Text is the decode of all the ids so far,
kept up to date a few ids at a time (:mod:`prunus.serve.detokenize`), so multi-byte
characters and multi-token words come out whole: a piece is held back while it ends
in an incomplete character or could be the start of a stop string.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from prunus.artifacts.errors import PrunusError

from .detokenize import IncrementalText

MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # run to max_new_tokens (benchmarks)
    logits: object = None  # a prunus.serve.logits_processors.LogitsSettings: penalties, logit_bias, logprobs
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end the request, besides the model's own
    adapter: str | None = None  # the name of a loaded LoRA adapter to run with (None: the base)

    def check(self, vocab_size: int | None = None) -> "SamplingParams":
        """Every field in range, in one place (``vocab_size``: the model's, which token ids must lie below);
        returns ``self``."""
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise PrunusError(f"max_new_tokens={self.max_new_tokens!r} must be a positive integer")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) or not 0 <= self.temperature < 1e6:
            raise PrunusError(f"temperature={self.temperature!r} must be a number from 0 (greedy) to below 1e6")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0):
            raise PrunusError(f"top_k={self.top_k!r} must be a non-negative integer")
        if self.top_p is not None and (not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1):
            raise PrunusError(f"top_p={self.top_p!r} must be a number in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -(2**63) <= self.seed < 2**64):  # what torch.Generator takes
            raise PrunusError(f"seed={str(self.seed)[:40]} must be an integer from -2**63 to 2**64 - 1")
        if len(self.stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in self.stop):
            raise PrunusError(f"stop={list(self.stop)!r} must be up to {MAX_STOP_STRINGS} non-empty strings")
        if self.logits is not None:
            self.logits.check(vocab_size)
        bound = vocab_size if vocab_size is not None else 2**31
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < bound for t in self.stop_token_ids):
            raise PrunusError(f"stop_token_ids must be token ids in [0, {bound})")
        if self.adapter is not None and not isinstance(self.adapter, str):
            raise PrunusError(f"adapter={self.adapter!r} must be the name of a loaded LoRA adapter")
        return self


@dataclass
class StreamToken:
    """One generated token: its id and the text it completes (may be empty while held back)."""

    id: int
    text: str
    logprob: object = None  # a prunus.serve.logits_processors.TokenLogprob when the request asked for logprobs


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "length" | "stop" (eos or a stop string)
    time_to_first_token_s: float
    decode_tokens_per_s: float  # tokens after the first / the time they took
    total_s: float


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: object
    stop_ids: tuple[int, ...] = ()  # tokens that end the request (end of text, end of turn)
    adapter: object = None  # a loaded LoRA adapter (prunus.runtime.lora_adapters.Adapter), None: the base
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    notify: object = None  # called after every event is put (an event loop's wake-up: prunus.serve.events)
    seen_tokens: object = None  # the penalties' running history (prunus.serve.logits_processors.SeenTokens)
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: list[int] = field(default_factory=list)
    slot: int | None = None
    last_token: int = 0  # the token the next decode step feeds
    finish_reason: str | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    n_tokens: int = 0  # tokens made, an end-of-text one included
    _emitted: int = 0  # characters of text already handed out
    _text: str = ""

    def __post_init__(self) -> None:
        self._decoded = IncrementalText(self.tokenizer)
        self.generator = None
        if self.params.temperature > 0:
            seed = self.params.seed if self.params.seed is not None else int(torch.randint(0, 2**62, ()).item())
            self.generator = torch.Generator().manual_seed(seed)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add_token(self, token: int, logprob=None) -> None:
        """Record one token (and its log-probability, if asked), decide whether the request is finished, and
        emit its event."""
        now = time.perf_counter()
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        self.n_tokens += 1
        if token in self.stop_ids:
            self.finish_reason = "stop"
            self._emit(StreamToken(token, self._take(final=True), logprob))
            return
        self.generated.append(token)
        searched = len(self._decoded.settled)  # no stop string lies wholly in the text settled before
        self._decoded.add(token)
        text = self._decoded.text
        hit = min((i for i in (text.find(s, max(searched - len(s) + 1, 0)) for s in self.params.stop) if i >= 0),
                  default=-1)
        if hit >= 0:
            self.finish_reason = "stop"
            self._text = text[:hit]
        else:
            self._text = text
            if len(self.generated) >= self.params.max_new_tokens:
                self.finish_reason = "length"
        self._emit(StreamToken(token, self._take(final=self.done), logprob))

    def _take(self, final: bool) -> str:
        """The text not yet handed out, minus what may still change (unless final)."""
        text = self._text
        end = len(text)
        if not final:
            while end > self._emitted and text[end - 1] == "\ufffd":  # an incomplete UTF-8 sequence so far
                end -= 1
            for s in self.params.stop:  # a tail that could grow into a stop string
                for k in range(min(len(s) - 1, end - self._emitted), 0, -1):
                    if text[end - k:end] == s[:k]:
                        end -= k
                        break
        piece = text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return piece

    def fail(self, error: BaseException) -> None:
        self.finish_reason = "error"
        self._emit(error)

    def finish(self) -> None:
        """Called by the scheduler once the request has left the batch."""
        self._emit(self.result())

    def _emit(self, event) -> None:
        self.events.put(event)
        notify = self.notify
        if notify is not None:
            notify()

    def result(self) -> GenerationResult:
        first = self.first_token_at or time.perf_counter()
        last = self.last_token_at or first
        n_after_first = max(self.n_tokens - 1, 0)
        return GenerationResult(
            text=self._text, token_ids=list(self.generated), prompt_tokens=len(self.prompt_ids),
            finish_reason=self.finish_reason or "cancelled", time_to_first_token_s=first - self.submitted,
            decode_tokens_per_s=n_after_first / (last - first) if last > first else 0.0, total_s=last - self.submitted,
        )
