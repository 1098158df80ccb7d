"""A distillation student's spec, read without a model: which derivations, with which numbers.

``keep-every:K`` and ``depth:N`` take a whole number of blocks of at least 1, ``width:F`` a finite
factor of at least 1; several join with commas (``keep-every:2,width:1.25``). The recipe check
reads a spec with :func:`parse_student` before any model is loaded, so ``width:nan`` or
``depth:-1`` is one line up front; whether a value fits the teacher (K and N at most its blocks,
F at most its key/value heads) is checked when :mod:`.student` makes the student. A preset name
or a mapping of config fields is left to it too. No torch here.
"""

from __future__ import annotations

import math

# kind -> (its letter in messages, whether it takes a whole number)
DERIVATIONS = {"keep-every": ("K", True), "depth": ("N", True), "width": ("F", False)}


def parse_derivation(part: str) -> tuple[str, int | float] | None:
    """``"width:1.5"`` -> ("width", 1.5); None when ``part`` is no derivation (a preset name, say).
    A derivation with a value out of its range raises ValueError saying why."""
    kind, sep, text = part.strip().partition(":")
    if not sep or kind not in DERIVATIONS:
        return None
    letter, whole = DERIVATIONS[kind]
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{kind}:{letter} takes a number, not {text.strip()!r}") from None
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"{kind}:{letter} takes a finite number of at least 1, not {text.strip()}")
    if not whole:
        return kind, value
    if value != int(value):
        raise ValueError(f"{kind}:{letter} takes a whole number of blocks, not {text.strip()}")
    return kind, int(value)


def parse_student(spec) -> list[tuple[str, int | float]] | None:
    """[(kind, value)] of a derived student (one derivation or several joined by commas); None for a
    preset name, a config mapping or None. Raises ValueError naming what is wrong with a derivation."""
    if not isinstance(spec, str):
        return None
    parts = spec.split(",")
    parsed = [parse_derivation(p) for p in parts]
    if len(parts) == 1:
        return None if parsed[0] is None else parsed
    if None in parsed:
        bad = parts[parsed.index(None)].strip()
        raise ValueError(f"{bad!r} is no derivation; join keep-every:K, depth:N and width:F with commas")
    return parsed


def check_student(spec) -> bool:
    """The recipe check of ``distill.student``: None, a mapping, a preset name or derivations in range."""
    if spec is None or isinstance(spec, dict):
        return True
    if not isinstance(spec, str) or not spec.strip():
        return False
    parse_student(spec)  # raises ValueError for a derivation out of range
    return True
