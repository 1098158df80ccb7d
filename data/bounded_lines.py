"""Text bounded before a tokenizer or a JSON parser sees it: the line-length cap and the nesting cap.

A tokenizer keeps bookkeeping per token for a whole input at once (Hugging Face's tokenizers: about
400 bytes a token, and a single 50 MB line aborted the process inside it); Python's JSON parser
recurses once per nesting level. So every line of training text is bounded before either runs:

* :data:`MAX_LINE_BYTES` (4 MiB): the most one line may hold, a JSONL row or a line of a text corpus
  (a Parquet row: its JSON form). Far above any real row (a 128k-token conversation is about
  0.5 MB); a longer one is refused by file and line, never truncated.
* :data:`MAX_JSON_DEPTH` (100): the deepest nesting of brackets a row may have (a chat row nests
  three deep), checked by a scan of the line's brackets before the parser recurses.

:func:`read_lines` reads a file a line at a time and never holds more than the cap of one line;
:func:`check_line_lengths` checks text already in memory (a text corpus) with one vectorised pass.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from prunus.artifacts.errors import PrunusError

MAX_LINE_BYTES = 4 << 20
MAX_JSON_DEPTH = 100

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string (brackets inside it do not nest)


def _too_long(where: str, fix: str) -> PrunusError:
    return PrunusError(f"{where}: longer than {MAX_LINE_BYTES:,} bytes, the most one line may hold before it is "
                       f"tokenized; {fix}")


def read_lines(path: str | Path, fix: str = "split the row or shorten it"):
    """``(line number, bytes)`` for each line of ``path`` (newline and a trailing CR removed); a line over
    :data:`MAX_LINE_BYTES` is one PrunusError line naming the file and line, raised before it is read whole."""
    path = Path(path)
    limit = MAX_LINE_BYTES + 1
    try:
        with open(path, "rb") as f:
            number = 0
            while line := f.readline(limit):
                number += 1
                if not line.endswith(b"\n") and len(line) == limit:
                    raise _too_long(f"{path} line {number}", fix)
                yield number, line.rstrip(b"\n").removesuffix(b"\r")
    except OSError as e:
        raise PrunusError(f"data {path}: cannot be read ({e.strerror or e}); fix the path or its permissions") from None


def check_line_lengths(data: bytes, source: str, fix: str = "break the text into lines") -> None:
    """Refuse text holding a line longer than :data:`MAX_LINE_BYTES`: one PrunusError line naming
    ``source`` and the first such line."""
    if len(data) <= MAX_LINE_BYTES:
        return
    ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
    lengths = np.diff(np.concatenate(([-1], ends, [len(data)]))) - 1
    long = np.flatnonzero(lengths > MAX_LINE_BYTES)
    if long.size:
        raise _too_long(f"{source} line {int(long[0]) + 1}", fix)


def too_deep(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON ``text`` nests brackets more than ``limit`` deep (strings skipped). Cheap: a line with
    no more than ``limit`` opening brackets is answered by counting them."""
    if text.count("[") + text.count("{") <= limit:
        return False
    bare = _STRING.sub("", text).encode("utf-8", "surrogatepass")
    codes = np.frombuffer(bare, dtype=np.uint8)
    steps = np.isin(codes, (91, 123)).astype(np.int32) - np.isin(codes, (93, 125))
    return int(np.cumsum(steps).max(initial=0)) > limit
