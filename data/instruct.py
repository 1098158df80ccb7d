"""Instruction data: JSONL or Parquet rows turned into token documents with a loss mask.

A row is one of
* ``{"text": ...}``: plain text, every token trained;
* ``{"prompt": ..., "completion": ...}``: the completion's tokens trained (and the end-of-text token);
* ``{"messages": [{"role", "content"}, ...]}``: rendered with the model's chat template
  (:mod:`prunus.models.chat_template`, as transformers renders it); the assistant turns trained.

``train_on_prompt`` trains every token instead. Each document becomes ``(tokens, trained)``: the ids
and a boolean per token saying whether predicting it counts in the loss; packing
(:mod:`prunus.data.packing`) turns them into inputs and targets with ``IGNORE_INDEX`` where a token
does not count. A chat is split at the assistant turns by rendering the conversation up to each turn
(with the generation prompt, then with the turn): the text between is the assistant's, its end-of-turn
marker included, so the model learns to stop.

Rows are read one at a time and checked as they come: a bad row is one :class:`PrunusError` line naming
the file and line (Parquet: row) number. Before any row is parsed or tokenized it is bounded
(:mod:`prunus.data.bounded_lines`: at most 4 MiB a line, JSON at most 100 deep), its integers must be
ones Python reads (at most 4,300 digits), its text must be UTF-8 (no lone surrogate such as ``"\\ud800"``),
and a chat row holds at most 1,024 messages.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short

from .bounded_lines import MAX_JSON_DEPTH, MAX_LINE_BYTES, read_lines, too_deep

INSTRUCT_SUFFIXES = (".jsonl", ".parquet")
MAX_MESSAGES = 1024  # messages in one chat row
ROW_KINDS = ('{"text"}', '{"prompt", "completion"}', '{"messages": [{"role", "content"}, ...]}')


@dataclass
class Document:
    """One row's tokens and, per token, whether predicting it counts in the loss."""

    tokens: np.ndarray  # int64 (n,)
    trained: np.ndarray  # bool (n,)
    where: str  # "FILE line N", for messages


def is_instruct_path(path) -> bool:
    return path is not None and Path(str(path)).suffix.lower() in INSTRUCT_SUFFIXES


def read_rows(path: str | Path):
    """``(where, row)`` for each row of a JSONL or Parquet file; where is "FILE line N" (Parquet: "FILE row N").
    Every row is bounded (:mod:`prunus.data.bounded_lines`) and is valid UTF-8 once read."""
    path = Path(path)
    if not path.is_file():
        raise PrunusError(f"data {path}: no such file; give a .jsonl or .parquet file of instruction rows")
    rows = _parquet_rows(path) if path.suffix.lower() == ".parquet" else _jsonl_rows(path)
    for where, row in rows:
        _check_row_text(row, where)
        yield where, row


def _jsonl_rows(path: Path):
    for i, raw in read_lines(path):
        where = f"{path} line {i}"
        try:
            line = raw.decode("utf-8").removeprefix("\ufeff" if i == 1 else "")
        except UnicodeDecodeError as e:
            raise PrunusError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of the line); save the file as "
                              "UTF-8") from None
        if not line.strip():
            continue
        if too_deep(line):
            raise PrunusError(f"{where}: JSON nested more than {MAX_JSON_DEPTH} deep; write a flat row "
                              f"({', '.join(ROW_KINDS)})")
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PrunusError(f"{where}: not JSON ({e.msg}); write one JSON object per line") from None
        except (ValueError, RecursionError) as e:  # an integer of more digits than Python converts
            reason = (f"an integer of more than {sys.get_int_max_str_digits():,} digits" if "digits" in str(e)
                      else short(str(e), 100))
            raise PrunusError(f"{where}: not usable JSON ({reason}); write long numbers as strings") from None
        yield where, row


def _parquet_rows(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrunusError(f"data {path}: reading Parquet needs pyarrow: pip install 'prunus[parquet]'") from None
    i = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
            for row in batch.to_pylist():
                i += 1
                yield f"{path} row {i}", row
    except Exception as e:  # pyarrow raises its own error types on bad files (and a deep schema: RecursionError)
        where = f"{path} row {i + 1}" if i else str(path)
        raise PrunusError(f"data {where}: not a readable Parquet file ({short(str(e), 160)}); re-write it with "
                          "pyarrow or pandas") from None


def _check_row_text(row, where: str) -> None:
    """Refuse a row whose text is not UTF-8 (a lone surrogate such as "\\ud800") or that is over the line cap."""
    try:
        size = len(canonical_json(row).encode("utf-8"))
    except UnicodeEncodeError as e:
        raise PrunusError(f"{where}: holds text that is not valid UTF-8 (a lone surrogate "
                          f"{short(e.object[e.start:e.end])}); remove it or re-encode the data") from None
    except (TypeError, ValueError, RecursionError):  # a Parquet value JSON cannot hold
        raise PrunusError(f"{where}: a value cannot be written as JSON; give plain strings and numbers") from None
    if size > MAX_LINE_BYTES:
        raise PrunusError(f"{where}: {size:,} bytes, above the {MAX_LINE_BYTES:,} one row may hold before it is "
                          "tokenized; split the row or shorten it")


def canonical_json(row) -> str:
    """One row as JSON with sorted keys (what the held-out split hashes); Parquet values JSON lacks (dates,
    bytes) are written as their text."""
    return json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)


def _text(row: dict, key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise PrunusError(f"{where}: '{key}' must be a string, not {type(value).__name__}")
    return value


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text)) if text else []


def chat_segments(tokenizer, messages, where: str) -> list[tuple[str, bool]]:
    """The rendered conversation as ``(text, is_assistant)`` pieces that join into the whole rendering."""
    def render(msgs, gen: bool) -> str:
        if not msgs:
            return ""
        try:
            return tokenizer.apply_chat_template(msgs, add_generation_prompt=gen)
        except PrunusError as e:
            raise PrunusError(f"{where}: {e}") from None

    if not hasattr(tokenizer, "apply_chat_template") or getattr(tokenizer, "chat_template", None) is None:
        raise PrunusError(f"{where}: 'messages' rows need a tokenizer with a chat template; give --tokenizer (or "
                          "--init-from) a model dir converted from a chat model, or use prompt/completion rows")
    full = render(messages, False)
    pieces, done = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[:i + 1], False)
        if not (through.startswith(before) and full.startswith(through) and len(before) >= done):
            raise PrunusError(f"{where}: the chat template does not render this conversation turn by turn, so the "
                              "assistant's tokens cannot be found; use prompt/completion rows")
        pieces += [(full[done:len(before)], False), (full[len(before):len(through)], True)]
        done = len(through)
    pieces.append((full[done:], False))
    return [(t, a) for t, a in pieces if t]


def _check_roles(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise PrunusError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    if len(messages) > MAX_MESSAGES:  # each assistant turn renders the conversation up to it: bounded work
        raise PrunusError(f"{where}: {len(messages):,} messages, above the {MAX_MESSAGES:,} one row may hold; "
                          "split the conversation into several rows")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise PrunusError(f"{where}: messages[{j}] needs a 'role' and a 'content' string")


def render_row(row, where: str, tokenizer, *, train_on_prompt: bool = False) -> Document:
    """One row as a :class:`Document` (see the module docstring for the row kinds)."""
    if not isinstance(row, dict):
        raise PrunusError(f"{where}: a row must be a JSON object, one of {', '.join(ROW_KINDS)}")
    eos = getattr(tokenizer, "eos_id", None)
    end = [eos] if eos is not None else []
    if "messages" in row and row["messages"] is not None:
        _check_roles(row["messages"], where)
        ids, trained = [], []
        for text, assistant in chat_segments(tokenizer, row["messages"], where):
            piece = _encode(tokenizer, text)
            ids += piece
            trained += [assistant or train_on_prompt] * len(piece)
    elif "prompt" in row or "completion" in row:
        prompt, completion = _encode(tokenizer, _text(row, "prompt", where)), _encode(tokenizer, _text(row, "completion", where))
        ids = prompt + completion + end
        trained = [train_on_prompt] * len(prompt) + [True] * (len(completion) + len(end))
    elif "text" in row:
        ids = _encode(tokenizer, _text(row, "text", where)) + end
        trained = [True] * len(ids)
    else:
        raise PrunusError(f"{where}: the row has none of the fields {', '.join(ROW_KINDS)} "
                          f"(it has {', '.join(map(repr, sorted(row)))[:120] or 'none'})")
    tokens = np.asarray(ids, dtype=np.int64)
    if len(tokens) < 2:
        raise PrunusError(f"{where}: the row renders to {len(tokens)} token(s); give it some text")
    return Document(tokens, np.asarray(trained, dtype=bool), where)


def held_out(row, val_fraction: float) -> bool:
    """Whether a row belongs to the held-out split: a hash of its content (stable when rows move)."""
    digest = hashlib.sha256(canonical_json(row).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < val_fraction


def load_documents(path: str | Path, tokenizer, *, vocab_size: int | None = None, train_on_prompt: bool = False,
                   val_fraction: float = 0.05) -> tuple[list[Document], list[Document]]:
    """(train documents, held-out documents) of an instruction file, every row checked."""
    train, val = [], []
    for where, row in read_rows(path):
        doc = render_row(row, where, tokenizer, train_on_prompt=train_on_prompt)
        if vocab_size is not None and int(doc.tokens.max()) >= vocab_size:
            raise PrunusError(f"{where}: token id {int(doc.tokens.max())} is outside the model's vocabulary of "
                              f"{vocab_size}; use the model's own tokenizer")
        (val if held_out(row, val_fraction) else train).append(doc)
    if not train and not val:
        raise PrunusError(f"data {path}: no rows; give one JSON object per line ({', '.join(ROW_KINDS)})")
    if not val:  # too few rows for the hash split: hold out the last one
        val.append(train.pop())
    if not train and len(val) > 1:
        train.append(val.pop(0))
    if not train:
        raise PrunusError(f"data {path}: one row is too few to train and hold out; give at least two rows")
    return train, val
