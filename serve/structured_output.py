"""Structured outputs: a JSON schema, any JSON object or a regular expression enforced token by token.

A request's constraint is compiled once into an xgrammar grammar over the model's vocabulary; each row then holds
a matcher. Every step, before sampling, the matcher advances over the tokens accepted since the last step and
masks the row's logits to the tokens that keep the text inside the grammar
(:func:`prunus.serve.logits_processors.process`); a stop token is allowed only once the grammar is complete.
Nothing is retried: the first answer is valid (unless ``max_tokens`` cuts it).

Compiling is bounded, as a compile's time grows with what the grammar asks far faster than with its text:

* a constraint past a cap of :class:`prunus.serve.grammar_limits.GrammarLimits` (string lengths, pattern sizes,
  nesting, properties) is one 400 line at once (:mod:`prunus.serve.grammar_limits`);
* a new grammar is compiled first in a worker process of the model's :class:`prunus.serve.grammar_pool.GrammarPool`
  (one at a time by default, a bounded queue: 429 past it), stopped at the deadline (400 naming the field) or
  when its client leaves; one that compiled in time is compiled again here, in a pool thread (xgrammar releases
  Python's lock), never on the event loop (:mod:`prunus.serve.grammar_worker` says why twice);
* compiled grammars are cached by the SHA-256 of their kind and text, per tokenizer (an LRU bounded in entries
  and bytes); a constraint refused, or stopped at the deadline, is remembered too, and refused at once.

xgrammar is the optional extra ``prunus[structured]``; without it a constrained request is one 400 line.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import json
import threading
import time
import weakref
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import torch

from prunus.artifacts.errors import PrunusError

from .grammar_limits import GrammarLimits, check_regex, check_schema
from .grammar_pool import GrammarPool, GrammarTimeout
from .grammar_worker import Refused, build

INSTALL = "install it with: pip install 'prunus[structured]'"
MAX_CONSTRAINT_CHARS = 100_000
CACHE_ENTRIES = 256  # compiled grammars kept per tokenizer
CACHE_BYTES = 256 << 20  # and their memory, per tokenizer
REFUSALS_KEPT = 256  # constraints refused, per tokenizer
CacheInfo = namedtuple("CacheInfo", "hits misses")
_LOCK = threading.Lock()
_STATS = {"hits": 0, "misses": 0}


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise PrunusError(f"structured outputs need xgrammar; {INSTALL}") from None
    return xgrammar


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar shared by every row of a request (and by later requests with the same text)."""

    compiled: object  # xgrammar.CompiledGrammar
    vocab_size: int
    what: str  # "json_schema", "json_object", "regex" or "tool_call": for messages
    match_s: float = 2.0  # seconds a request may spend matching under it (GrammarLimits.match_s)

    def matcher(self, stop_ids: tuple[int, ...]):
        xgr = _xgrammar()
        return xgr.GrammarMatcher(self.compiled, override_stop_tokens=list(stop_ids) or None)


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's view of a prunus tokenizer: the byte tokenizer's 256 bytes, or a Hugging Face tokenizer.json."""
    xgr = _xgrammar()
    stops = list(tokenizer.stop_ids)
    if getattr(tokenizer, "spec", lambda: {})().get("kind") == "byte":
        vocab = [bytes([i]) for i in range(256)] + [b""] * (tokenizer.n_vocab - 256)
        return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
    path = getattr(tokenizer, "path", None)
    if path is None:
        raise PrunusError("structured outputs need the byte tokenizer or a Hugging Face tokenizer.json; "
                          "serve a model dir that carries one")
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stops)


def constraint_text(what: str, value, field: str, limits: GrammarLimits) -> str:
    """The text xgrammar compiles for ``value`` (a schema as a dict or JSON text, or a regex), checked against
    ``limits``; one PrunusError line naming ``field`` otherwise."""
    if what == "json_object":
        return ""
    schema = what in ("json_schema", "tool_call")
    try:
        text = value if isinstance(value, str) or not schema else json.dumps(value)  # key order orders the answer
    except (RecursionError, TypeError, ValueError):
        raise PrunusError(f"'{field}' cannot be written as JSON; fix it") from None
    text = text or ""
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise PrunusError(f"'{field}' holds {len(text)} characters; give at most {MAX_CONSTRAINT_CHARS}")
    if not schema:
        check_regex(text, limits, field)
        return text
    if isinstance(value, str):
        try:
            value = json.loads(text)
        except (RecursionError, ValueError) as e:
            raise PrunusError(f"'{field}' is not a JSON schema prunus can enforce (not JSON: "
                              f"{str(e)[:80]}); fix it") from None
    check_schema(value, limits, field)
    return text


def _refusal(what: str, field: str, message: str) -> str:
    detail = " ".join(message.split()).split("] ", 1)[-1][:200]  # xgrammar's messages begin with a time and a source
    noun = "regular expression" if what == "regex" else "JSON schema"
    return f"'{field}' is not a {noun} prunus can enforce ({detail}); fix it"


class _Model:
    """What one tokenizer (at one vocabulary size) compiles with: xgrammar's tokenizer info, the compile pool,
    the cache of compiled grammars and of refusals."""

    def __init__(self, tokenizer, vocab_size: int, limits: GrammarLimits | None = None):
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size)
        self.compiler = _xgrammar().GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.pool = GrammarPool(self.info.serialize_json, limits)
        self.grammars: OrderedDict[str, Grammar] = OrderedDict()
        self.refused: OrderedDict[str, tuple[str, str]] = OrderedDict()  # key -> (kind, message without field)
        self.lock = threading.Lock()

    @property
    def limits(self) -> GrammarLimits:
        return self.pool.limits

    def lookup(self, key: str, what: str, field: str):
        """The cached grammar of ``key``, or None; its remembered refusal raised."""
        with self.lock:
            grammar, refused = self.grammars.get(key), self.refused.get(key)
            if grammar is not None:
                self.grammars.move_to_end(key)
            _STATS["hits" if grammar is not None or refused else "misses"] += 1
        if refused is not None:
            kind, message = refused
            raise PrunusError(_refusal(what, field, message) if kind == "refused" else f"'{field}' {message}")
        return grammar

    def refuse(self, key: str, kind: str, message: str) -> None:
        with self.lock:
            self.refused[key] = (kind, message)
            while len(self.refused) > REFUSALS_KEPT:
                self.refused.popitem(last=False)

    def compile_here(self, key: str, what: str, text: str) -> "Grammar":
        """xgrammar's compile in this process (after a worker's compiled the same in time), kept in the cache."""
        try:
            grammar = Grammar(build(_xgrammar(), self.compiler, what, text), self.vocab_size, what, self.limits.match_s)
        except Exception as e:  # noqa: BLE001 - the worker compiled it; a refusal here is xgrammar's all the same
            raise Refused(" ".join(str(e).split())[:600]) from None
        with self.lock:
            self.grammars[key] = grammar
            while len(self.grammars) > CACHE_ENTRIES or (len(self.grammars) > 1 and sum(
                    g.compiled.memory_size_bytes for g in self.grammars.values()) > CACHE_BYTES):
                self.grammars.popitem(last=False)
        return grammar


_MODELS: "weakref.WeakKeyDictionary[object, dict[int, _Model]]" = weakref.WeakKeyDictionary()


def _model(tokenizer, vocab_size: int) -> _Model:
    with _LOCK:
        per_vocab = _MODELS.setdefault(tokenizer, {})
        model = per_vocab.get(vocab_size)
        if model is None:
            model = per_vocab[vocab_size] = _Model(tokenizer, vocab_size)
            weakref.finalize(tokenizer, model.pool.close)
        return model


def set_limits(tokenizer, vocab_size: int, limits: GrammarLimits) -> None:
    """Compile for ``tokenizer`` under ``limits`` from now on (the environment's otherwise). Refusals remembered
    are forgotten; a new pool (new worker processes) only when ``workers`` or ``queue`` change."""
    _xgrammar()
    model = _model(tokenizer, vocab_size)
    with model.lock:
        model.refused.clear()
    old = model.pool
    if (old.limits.workers, old.limits.queue) == (limits.workers, limits.queue) and not old.closed:
        old.limits = limits
        return
    model.pool = GrammarPool(model.info.serialize_json, limits)
    weakref.finalize(tokenizer, model.pool.close)
    old.close()


def pool_of(tokenizer, vocab_size: int) -> GrammarPool:
    """The compile pool of ``tokenizer`` (made on first use)."""
    _xgrammar()
    return _model(tokenizer, vocab_size).pool


def _key(what: str, text: str) -> str:
    return hashlib.sha256(f"{what}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()


def _settle(model: _Model, key: str, what: str, field: str, outcome) -> "Grammar":
    """The grammar from a compile's ``outcome`` (the grammar, or what the pool raised), or a PrunusError line
    naming ``field`` (a refusal, a deadline passed, remembered for the next time)."""
    if isinstance(outcome, Grammar):
        return outcome
    if isinstance(outcome, Refused):
        model.refuse(key, "refused", str(outcome))
        raise PrunusError(_refusal(what, field, str(outcome))) from None
    if isinstance(outcome, GrammarTimeout):
        model.refuse(key, "stopped", str(outcome))
    if isinstance(outcome, PrunusError):
        raise type(outcome)(f"'{field}' {outcome}") from None
    raise outcome


def _cached(model: _Model, what: str, value, field: str) -> tuple[str, str, "Grammar | None"]:
    """The constraint's text (checked against the model's caps), its cache key, and its cached grammar or None."""
    text = constraint_text(what, value, field, model.limits)
    key = _key(what, text)
    return text, key, model.lookup(key, what, field)


def compile_constraint(tokenizer, vocab_size: int, what: str, value, field: str) -> "Grammar":
    """The grammar of ``value`` (a schema as a dict or JSON text, or a regex), compiled within the model's limits
    (blocking), or one PrunusError line naming ``field``. Cached by its kind and text."""
    _xgrammar()
    model = _model(tokenizer, vocab_size)
    text, key, grammar = _cached(model, what, value, field)
    if grammar is not None:
        return grammar
    try:
        model.pool.admit()
        outcome = model.pool.run(what, text, threading.Event(), lambda: model.compile_here(key, what, text))
    except (Refused, PrunusError) as e:
        outcome = e
    return _settle(model, key, what, field, outcome)


async def compile_request(tokenizer, vocab_size: int, what: str, value, field: str, receive=None) -> "Grammar":
    """:func:`compile_constraint` for the server: never blocking the event loop, stopped (ClientGone) when
    ``receive`` reports the client gone. GrammarBusy (429) when the model's compile queue is full."""
    loop = asyncio.get_running_loop()
    _xgrammar()
    model = await loop.run_in_executor(None, _model, tokenizer, vocab_size)  # tokenizer tables: seconds, once
    text, key, grammar = _cached(model, what, value, field)
    if grammar is not None:
        return grammar
    try:
        outcome = await model.pool.compile(what, text, lambda: model.compile_here(key, what, text), receive)
    except (Refused, PrunusError) as e:
        outcome = e
    return _settle(model, key, what, field, outcome)


def cache_info() -> CacheInfo:
    """Compiled-grammar cache hits (refusals remembered included) and misses, over every tokenizer."""
    return CacheInfo(_STATS["hits"], _STATS["misses"])


@atexit.register
def _close_pools() -> None:
    for per_vocab in list(_MODELS.values()):
        for model in per_vocab.values():
            model.pool.close()


def mask_row(out: torch.Tensor, grammar: Grammar, request) -> None:
    """Advance ``request``'s matcher over the tokens it accepted since the last step, then set every token the
    grammar forbids next to -inf in ``out`` (a float32 row, changed in place).

    A row no token can continue (a regex that matches nothing), or whose matching has taken more than the grammar's
    ``match_s`` seconds in all (an ambiguous regex such as ``(a*a*)*b`` makes each step slower than the last, and
    the steps run in the engine's one scheduler thread), may only stop: it ends at its stop token, rather than
    failing its batch or holding every other request back."""
    xgr = _xgrammar()
    if getattr(request, "grammar_dead_end", None):  # it may only stop from now on; its matcher is left behind
        return _only_stop(out, request, request.grammar_dead_end)
    state = getattr(request, "grammar_state", None)
    if state is None:
        state = request.grammar_state = [grammar.matcher(tuple(request.stop_ids)), 0,
                                         xgr.allocate_token_bitmask(1, grammar.vocab_size), 0.0]
    matcher, seen, bitmask, spent = state
    start = time.perf_counter()
    for token in request.generated[seen:]:
        if not matcher.accept_token(token):
            raise PrunusError(f"token {token} left the {grammar.what} grammar")  # cannot happen under the mask
    state[1] = len(request.generated)
    if matcher.is_terminated():
        return
    if spent > grammar.match_s:
        return _only_stop(out, request, f"its {grammar.what} grammar took over {grammar.match_s:g} s to match")
    matcher.fill_next_token_bitmask(bitmask)
    xgr.apply_token_bitmask_inplace(out.view(1, -1), bitmask.to(out.device), vocab_size=grammar.vocab_size)
    state[3] = spent + time.perf_counter() - start
    if not bool(torch.isfinite(out).any()):
        _only_stop(out, request, f"its {grammar.what} grammar allows no next token")


def _only_stop(out: torch.Tensor, request, why: str) -> None:
    """Leave ``request``'s row only its stop tokens (a row with none: every token, so that sampling never meets a
    row with nothing to sample; its matcher is not consulted again)."""
    request.grammar_dead_end = why
    out.fill_(float("-inf") if request.stop_ids else 0.0)
    if request.stop_ids:
        out[list(request.stop_ids)] = 0.0
