"""JSON text a client or a model wrote, parsed only within bounds.

Python's :func:`json.loads` recurses once per level of nesting and raises RecursionError near a thousand levels,
and what it returns is handed on to code that recurses again (``json.dumps``, a chat template). So text is
scanned first, without recursion, for its bracket depth (brackets inside strings do not count), and is parsed
only when it is at most :data:`MAX_DEPTH` levels deep and :data:`MAX_CHARS` characters long. ``NaN``,
``Infinity``, numbers beyond a float and lone surrogates (``"\\ud800"``, which no answer can encode as UTF-8)
are not JSON here either. Every refusal is a ValueError (:class:`TooDeep` for the bounds).
"""

from __future__ import annotations

import json
import math
import re

from .http_guard import MAX_JSON_DEPTH

MAX_DEPTH = MAX_JSON_DEPTH  # the nesting a request body may have
MAX_CHARS = 1 << 20  # a request body's bound (prunus.serve.asgi_guard.MAX_BODY_BYTES)
_TOKENS = re.compile(r'[\[\]{}"\\]')


class TooDeep(ValueError):
    """Text beyond :data:`MAX_DEPTH` levels or :data:`MAX_CHARS` characters."""


def json_depth(text: str, stop_above: int | None = None) -> int:
    """The deepest bracket nesting of ``text`` outside JSON strings (0 for a scalar), found by one linear scan;
    with ``stop_above`` the scan ends as soon as the depth passes it."""
    depth = deepest = 0
    in_string, skip = False, -1  # skip: the position of a character a backslash escapes
    for m in _TOKENS.finditer(text):
        c, at = m.group(), m.start()
        if at == skip:
            continue
        if in_string:
            if c == "\\":
                skip = at + 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if stop_above is not None and deepest > stop_above:
                break
        elif c in "]}":
            depth -= 1
    return deepest


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: no float holds it, and json.dumps would write Infinity
        raise ValueError(f"{text[:20]} is beyond a float's range")
    return value


def loads_bounded(text: str, max_depth: int = MAX_DEPTH, max_chars: int = MAX_CHARS):
    """``text`` parsed as JSON, or ValueError: not JSON, deeper than ``max_depth`` or longer than ``max_chars``
    (:class:`TooDeep`), or holding NaN, Infinity or a lone surrogate."""
    if len(text) > max_chars:
        raise TooDeep(f"longer than {max_chars} characters")
    if json_depth(text, stop_above=max_depth) > max_depth:
        raise TooDeep(f"nested deeper than {max_depth} levels")
    value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite)
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("holds a lone surrogate, which is not text") from None
    return value
