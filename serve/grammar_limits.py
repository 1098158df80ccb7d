"""What a structured-output constraint may ask of the grammar compiler, checked before it compiles.

xgrammar's compile time grows with what the grammar makes it expand, not with the schema's characters: four
enum strings of 24,000 characters sharing a prefix (96 KB) compile for minutes, ``"pattern": ".{0,2048}"`` for
seconds, an object of 200 properties with ``minProperties`` for a minute. :func:`check_schema` and
:func:`check_regex` measure those quantities (one pass, no recursion) and refuse a constraint past a cap with
one :class:`PrunusError` line naming the request's field; what passes still compiles under the deadline of
:mod:`prunus.serve.grammar_pool`.

Each cap is a field of :class:`GrammarLimits`, set by the environment variable its metadata names (read when a
server compiles its first grammar). The defaults sit well above what schemas written for an API use (OpenAI's
own limits: 10 levels of nesting, 15,000 to 120,000 characters of names and enum values) and an at-cap schema
compiles in well under the deadline (tests/test_grammar_bounds.py measures it on the byte tokenizer).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields

from prunus.artifacts.errors import PrunusError

WIDE = 4  # weight of a regex atom that matches multi-byte UTF-8 ('.', [^...], \S, \p{..}): up to 4 bytes
_QUANTIFIER = re.compile(r"\{(\d{1,9})(,(\d{0,9}))?\}")
_LITERAL_KEYS = ("enum", "const")
_DATA_KEYS = (*_LITERAL_KEYS, "default", "examples")  # keywords whose values are data, not schemas
_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema


def _cap(env: str, text: str, default) -> object:
    return field(default=default, metadata={"env": env, "help": text})


@dataclass(frozen=True)
class GrammarLimits:
    """The compile deadline, the compile pool's size and the caps on what one constraint may ask."""

    timeout_s: float = _cap("PRUNUS_GRAMMAR_TIMEOUT_S", "CPU seconds one grammar may compile (a loaded "
                                  "machine waits at most 4 times as long)", 10.0)
    match_s: float = _cap("PRUNUS_GRAMMAR_MATCH_S", "seconds one request's grammar may spend matching its tokens "
                          "while it generates (an ambiguous regex slows every step)", 2.0)
    workers: int = _cap("PRUNUS_GRAMMAR_WORKERS", "grammar compiles run at once per model, each in its own process", 1)
    queue: int = _cap("PRUNUS_GRAMMAR_QUEUE", "compiles that may wait for a worker before a 429", 8)
    max_depth: int = _cap("PRUNUS_GRAMMAR_MAX_DEPTH", "nesting of a schema's JSON objects and arrays", 64)
    max_string: int = _cap("PRUNUS_GRAMMAR_MAX_STRING",
                           "characters of one enum or const value or one property name", 512)
    max_strings: int = _cap("PRUNUS_GRAMMAR_MAX_STRINGS",
                            "characters of all enum and const values and property names of a schema", 16_384)
    max_regex: int = _cap("PRUNUS_GRAMMAR_MAX_REGEX",
                          "size of one regex with its repetitions written out ('.' and other wide classes "
                          f"count {WIDE})", 1024)
    max_regexes: int = _cap("PRUNUS_GRAMMAR_MAX_REGEXES", "the sizes of all of a schema's patterns", 2048)
    max_optional: int = _cap("PRUNUS_GRAMMAR_MAX_OPTIONAL", "properties of one object that are not required", 128)
    max_optionals: int = _cap("PRUNUS_GRAMMAR_MAX_OPTIONALS", "properties not required, in all of a schema's objects",
                              512)
    max_counted: int = _cap("PRUNUS_GRAMMAR_MAX_COUNTED",
                            "properties of all of a schema's objects with minProperties or maxProperties", 32)

    @classmethod
    def from_env(cls, environ=None) -> "GrammarLimits":
        """The defaults, each replaced by its environment variable where set (one line for a bad value)."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw is None or not raw.strip():
                continue
            least = 0 if f.name in ("queue", "timeout_s") else 1
            try:
                value = type(f.default)(raw.strip())
            except ValueError:
                value = None
            if value is None or not value >= least or (f.name == "timeout_s" and not 0 < value < 1e6):
                kind = "a number of seconds above 0" if f.name == "timeout_s" else f"a whole number from {least}"
                raise PrunusError(f"{f.metadata['env']}={raw[:40]!r}: give {kind} ({f.metadata['help']}; default "
                                  f"{f.default})")
            values[f.name] = value
        return cls(**values)


class _Tally:
    """What a constraint asks, summed over one walk; ``noun`` names it in messages."""

    def __init__(self, limits: GrammarLimits, where: str, noun: str = "the schema"):
        self.limits, self.where, self.noun = limits, where, noun
        self.strings = self.regexes = self.optionals = self.counted = 0

    def refuse(self, what: str, cap: str) -> None:
        env = next(f.metadata["env"] for f in fields(GrammarLimits) if f.name == cap)
        raise PrunusError(f"'{self.where}' {what}; prunus compiles at most {getattr(self.limits, cap):,} ({env}); "
                          f"simplify {self.noun}")

    def string(self, value) -> None:
        n = len(value) if isinstance(value, str) else _json_chars(value, self.limits.max_string)
        if n > self.limits.max_string:
            self.refuse(f"has an enum / const value or property name of {n:,} characters", "max_string")
        self.strings += n
        if self.strings > self.limits.max_strings:
            self.refuse(f"has {self.strings:,} characters or more of enum / const values and property names",
                        "max_strings")

    def regex(self, pattern) -> None:
        if not isinstance(pattern, str):
            return  # not a pattern xgrammar reads: its own message says so
        size = regex_size(pattern, self.limits.max_regex)
        if size > self.limits.max_regex:
            self.refuse(f"has a regex of size {size:,} or more with its repetitions written out", "max_regex")
        self.regexes += size
        if self.regexes > self.limits.max_regexes:
            self.refuse(f"has patterns of size {self.regexes:,} in all with their repetitions written out",
                        "max_regexes")

    def schema(self, node: dict) -> None:
        for key in _LITERAL_KEYS:
            if key in node:
                for value in (node[key] if key == "enum" and isinstance(node[key], list) else [node[key]]):
                    self.string(value)
        self.regex(node.get("pattern"))
        props = node.get("properties")
        if isinstance(props, dict):
            for name in props:
                self.string(name)
            required = node.get("required")
            named = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
            optional = len(set(props) - named)
            if optional > self.limits.max_optional:
                self.refuse(f"has an object of {optional:,} optional properties", "max_optional")
            self.optionals += optional
            if self.optionals > self.limits.max_optionals:
                self.refuse(f"has {self.optionals:,} optional properties or more in all", "max_optionals")
            if "minProperties" in node or "maxProperties" in node:
                self.counted += len(props)
                if self.counted > self.limits.max_counted:
                    self.refuse(f"has {self.counted:,} properties or more in objects with minProperties / "
                                "maxProperties", "max_counted")
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict):
            for pattern in patterns:
                self.regex(pattern)


def check_schema(schema, limits: GrammarLimits, where: str) -> None:
    """Refuse ``schema`` (a parsed JSON schema) past any of ``limits``' caps, in one line naming ``where``.
    The walk is iterative and reads the schema's structure: the values of ``properties`` / ``$defs`` / ... are
    schemas, ``enum`` / ``const`` / ``default`` / ``examples`` hold data (only their nesting counts), any other
    object or array a keyword holds is read as schema(s)."""
    tally = _Tally(limits, where)
    stack = [(schema, 1, "schema")]
    while stack:
        node, depth, kind = stack.pop()
        if depth > limits.max_depth:
            tally.refuse(f"nests objects and arrays more than {limits.max_depth} deep", "max_depth")
        if isinstance(node, dict) and kind == "schema":
            tally.schema(node)
        stack.extend((value, depth + 1, inner) for value, inner in _children(node, kind))


def _children(node, kind: str):
    """(value, its kind) of each object or array in ``node``, a "schema", a "map" of schemas or "data"."""
    pairs = node.items() if isinstance(node, dict) else ((None, v) for v in node)
    for key, value in pairs:
        if not isinstance(value, (dict, list)):
            continue
        if isinstance(node, dict) and kind == "map":
            yield value, "schema"
        elif isinstance(node, dict) and kind == "schema":
            yield value, "data" if key in _DATA_KEYS else "map" if key in _MAP_KEYS else "schema"
        else:
            yield value, kind


def _json_chars(value, cap: int) -> int:
    """The characters of ``value`` as JSON text (past ``cap`` when it cannot be written)."""
    try:
        return len(json.dumps(value))
    except (RecursionError, TypeError, ValueError):
        return cap + 1


def check_regex(pattern: str, limits: GrammarLimits, where: str) -> None:
    """Refuse a regular expression past ``limits.max_regex``, in one line naming ``where``."""
    _Tally(limits, where, "the regular expression").regex(pattern)


def regex_size(pattern: str, stop_above: int | None = None) -> int:
    """The characters ``pattern`` stands for with each bounded repetition written out (``{m,n}`` multiplies
    what it repeats by the larger bound, nested ones multiply again; alternatives add; ``*``, ``+`` and ``?``
    count once; an atom that can match multi-byte UTF-8 counts :data:`WIDE`). One linear scan; with
    ``stop_above`` it ends once past it. A regex xgrammar cannot parse is measured as well as it goes, and
    refused by xgrammar itself."""
    stack = [[0, 0]]  # per open group: [size so far, size of its last atom]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            size, i = _escape(pattern, i)
        elif c == "[":
            size, i = _char_class(pattern, i)
        elif c == "(":
            stack.append([0, 0])
            i += 1
            continue
        elif c == ")":
            size = stack.pop()[0] if len(stack) > 1 else 0
            i += 1
        elif c == "{" and (m := _QUANTIFIER.match(pattern, i)):
            low, high = int(m.group(1)), m.group(3)
            times = max(low, int(high) if high else low, 1)
            top = stack[-1]
            top[0] += top[1] * (times - 1)
            top[1] *= times
            i = m.end()
            if stop_above is not None and sum(s[0] for s in stack) > stop_above:
                break
            continue
        elif c in "*+?|^$":
            i += 1
            if c == "|":
                stack[-1][1] = 0
            continue
        else:
            size, i = (WIDE if c == "." or ord(c) > 127 else 1), i + 1
        stack[-1][0] += size
        stack[-1][1] = size
    return sum(s[0] for s in stack)


def _escape(pattern: str, i: int) -> tuple[int, int]:
    """(size, next position) of the escape at ``i``: ``\\p{..}``, ``\\u{..}``, ``\\x{..}`` skip their braces."""
    c = pattern[i + 1:i + 2]
    j = i + 2
    if c in ("p", "P", "u", "x") and pattern[j:j + 1] == "{":
        j = pattern.find("}", j)
        j = len(pattern) if j < 0 else j + 1
    elif c == "u":
        j += 4
    elif c == "x":
        j += 2
    return (WIDE if c in "DSWpP" or c == "u" else 1), j


def _char_class(pattern: str, i: int) -> tuple[int, int]:
    """(size, next position) of the class opening at ``i``: :data:`WIDE` when negated or reaching past ASCII."""
    j = i + 1
    negated = pattern[j:j + 1] == "^"
    j += negated
    if pattern[j:j + 1] == "]":
        j += 1
    wide = negated
    while j < len(pattern) and pattern[j] != "]":
        if pattern[j] == "\\":
            wide = wide or pattern[j + 1:j + 2] in ("D", "S", "W", "p", "P", "u")
            j += 2
            continue
        wide = wide or ord(pattern[j]) > 127
        j += 1
    return (WIDE if wide else 1), j + 1
