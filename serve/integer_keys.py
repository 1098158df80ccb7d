"""Integers that arrive as JSON strings (``logit_bias``'s token ids), read by one strict rule.

Python's ``str.isdigit`` and ``int`` take more than ASCII digits: ``"²"`` passes ``isdigit`` and fails ``int``,
``"٣"`` (Arabic-Indic) and ``"３"`` (full-width) are read as 3, ``" 3"`` and ``"3_0"`` parse, and a key of
thousands of digits makes ``int`` raise. Here a key is ASCII decimal digits in plain form (no spaces, ``+``,
``_`` or leading zeros; a leading ``-`` only where the field takes negatives), at most :data:`MAX_DIGITS` of
them, within the field's range; anything else is one 400 naming the field and the key.
"""

from __future__ import annotations

import re

from .http_guard import BadRequest

MAX_DIGITS = 10
_UNSIGNED = re.compile(r"0|[1-9][0-9]{0,%d}" % (MAX_DIGITS - 1))
_SIGNED = re.compile(r"0|-?[1-9][0-9]{0,%d}" % (MAX_DIGITS - 1))


def integer_key(key, field: str, low: int, high: int, what: str = "an integer") -> int:
    """``key`` as an int in [low, high], or BadRequest(400) naming ``field`` and the key."""
    pattern = _SIGNED if low < 0 else _UNSIGNED
    if isinstance(key, str) and pattern.fullmatch(key) and low <= int(key) <= high:
        return int(key)
    shown = repr(key[:24] + "..." if len(key) > 24 else key) if isinstance(key, str) else repr(key)
    raise BadRequest(400, f"'{field}' key {shown} is not {what} from {low} to {high}; write it in plain ASCII "
                          "decimal digits", param=field)


def token_id(key, field: str, vocab_size: int | None) -> int:
    """A token id given as a string key (``logit_bias``): within [0, vocab_size) when the vocabulary is known."""
    high = vocab_size - 1 if vocab_size else 10 ** MAX_DIGITS - 1
    return integer_key(key, field, 0, high, what="a token id")
