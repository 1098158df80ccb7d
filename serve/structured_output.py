"""Structured outputs: a JSON schema, any JSON object or a regular expression enforced token by token.

A request's constraint is compiled once into an xgrammar grammar over the model's vocabulary (compiled grammars
are cached by their text, per tokenizer); each row then holds a matcher. Every step, before sampling, the
matcher advances over the tokens accepted since the last step and masks the row's logits to the tokens that
keep the text inside the grammar (:func:`prunus.serve.logits_processors.process`); a stop token is allowed only
once the grammar is complete. Nothing is retried: the first answer is valid (unless ``max_tokens`` cuts it).

xgrammar is the optional extra ``prunus[structured]``; without it a constrained request is one 400 line.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from functools import lru_cache

import torch

from prunus.artifacts.errors import PrunusError

INSTALL = "install it with: pip install 'prunus[structured]'"
MAX_CONSTRAINT_CHARS = 100_000
_LOCK = threading.Lock()  # xgrammar's compiler is built once per tokenizer


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


@lru_cache(maxsize=8)
def _compiler(tokenizer, vocab_size: int):
    return _xgrammar().GrammarCompiler(tokenizer_info(tokenizer, vocab_size), max_threads=1)


@lru_cache(maxsize=256)
def _compile(tokenizer, vocab_size: int, what: str, text: str) -> Grammar:
    with _LOCK:
        compiler = _compiler(tokenizer, vocab_size)
    if what == "regex":
        compiled = compiler.compile_regex(text)
    elif what == "tool_call":  # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> (prunus.serve.tool_calls)
        xgr = _xgrammar()
        compiled = compiler.compile_grammar(xgr.Grammar.concat(
            xgr.Grammar.from_regex(r"<tool_call>\n"), xgr.Grammar.from_json_schema(text, any_whitespace=False),
            xgr.Grammar.from_regex(r"\n</tool_call>")))
    else:  # json_object: any JSON object (OpenAI's JSON mode); whitespace as json.dumps writes it
        compiled = compiler.compile_json_schema(text if what == "json_schema" else '{"type": "object"}',
                                                any_whitespace=False)
    return Grammar(compiled, vocab_size, what)


def compile_constraint(tokenizer, vocab_size: int, what: str, value, field: str) -> Grammar:
    """The grammar of ``value`` (a schema as a dict or JSON text, or a regex), or one PrunusError line naming
    ``field``. Cached by its canonical text."""
    if what in ("json_schema", "tool_call"):
        text = value if isinstance(value, str) else json.dumps(value)  # key order kept: it orders the answer's keys
    else:
        text = value or ""
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise PrunusError(f"'{field}' holds {len(text)} characters; give at most {MAX_CONSTRAINT_CHARS}")
    try:
        return _compile(tokenizer, vocab_size, what, text)
    except PrunusError:
        raise
    except (RuntimeError, ValueError, TypeError) as e:
        detail = " ".join(str(e).split())
        detail = detail.split("] ", 1)[-1][:200]  # xgrammar's messages begin with a time and a source line
        noun = "regular expression" if what == "regex" else "JSON schema"
        raise PrunusError(f"'{field}' is not a {noun} prunus can enforce ({detail}); fix it") from None


def mask_row(out: torch.Tensor, grammar: Grammar, request) -> None:
    """Advance ``request``'s matcher over the tokens it accepted since the last step, then set every token the
    grammar forbids next to -inf in ``out`` (a float32 row, changed in place)."""
    xgr = _xgrammar()
    state = getattr(request, "grammar_state", None)
    if state is None:
        state = request.grammar_state = [grammar.matcher(tuple(request.stop_ids)), 0,
                                         xgr.allocate_token_bitmask(1, grammar.vocab_size)]
    matcher, seen, bitmask = state
    for token in request.generated[seen:]:
        if not matcher.accept_token(token):
            raise PrunusError(f"token {token} left the {grammar.what} grammar")  # cannot happen under the mask
    state[1] = len(request.generated)
    if matcher.is_terminated():
        return
    matcher.fill_next_token_bitmask(bitmask)
    xgr.apply_token_bitmask_inplace(out.view(1, -1), bitmask.to(out.device), vocab_size=grammar.vocab_size)
