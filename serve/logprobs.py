"""Log-probabilities in OpenAI's two shapes, from the engine's per-token
:class:`~prunus.serve.logits_processors.TokenLogprob` (the log-softmax of the logits after bias and penalties,
before temperature, top-k and top-p).

* completions (``logprobs: k``): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
  "text_offset"}``;
* chat (``logprobs: true, top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}]}]}``.

A token's text is the decode of that one id, special tokens (end of turn) as their own text; in the completions shape, alternatives that decode alike share one
key, holding the likelier one's value (a piece of a multi-byte character may decode to U+FFFD; its
``bytes`` in chat are those of the decoded text).
"""

from __future__ import annotations

from .logits_processors import TokenLogprob


def _text(tokenizer, token_id: int) -> str:
    """The token's own text, a special token's included (an end-of-turn token reads as itself, never as "")."""
    return tokenizer.token_text(token_id)


def completion_logprobs(tokenizer, token_ids: list[int], entries: list[TokenLogprob | None],
                        offset: int = 0) -> dict:
    """``entries[i]`` None: a token with no log-probability (an echoed prompt's first), written null."""
    tokens = [_text(tokenizer, t) for t in token_ids[:len(entries)]]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    top = [_best_first(tokenizer, e.top) if e is not None and e.top else None for e in entries]
    return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": top, "text_offset": offsets}


def joined(first: dict | None, second: dict) -> dict:
    """Two completions-shaped log-probability records one after the other (an echoed prompt, then its answer)."""
    if first is None:
        return second
    shift = first["text_offset"][-1] + len(first["tokens"][-1]) if first["tokens"] else 0
    return {"tokens": first["tokens"] + second["tokens"],
            "token_logprobs": first["token_logprobs"] + second["token_logprobs"],
            "top_logprobs": first["top_logprobs"] + second["top_logprobs"],
            "text_offset": first["text_offset"] + [o + shift for o in second["text_offset"]]}


def _best_first(tokenizer, top) -> dict:
    """{text: logprob} of the alternatives; ids that decode alike keep the likelier one's value."""
    out: dict[str, float] = {}
    for token_id, value in top:
        out.setdefault(_text(tokenizer, token_id), value)
    return out


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[TokenLogprob]) -> dict:
    content = []
    for t, e in zip(token_ids, entries):
        entry = _chat_entry(_text(tokenizer, t), e.logprob)
        entry["top_logprobs"] = [_chat_entry(_text(tokenizer, i), v) for i, v in e.top]
        content.append(entry)
    return {"content": content}
