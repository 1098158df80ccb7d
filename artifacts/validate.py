"""Checks at the boundary: a file or value from outside becomes one PrunusError line, never a traceback.

* :func:`read_text` / :func:`read_json_object` / :func:`read_dir_json`: a bounded read of a small text file
  (config.json, prunus.json, run.json, train_state.json, TOML, YAML), UTF-8 checked,
  JSON parsed without NaN, without digit strings Python refuses, without nesting
  that exhausts the stack, and required to be an object.
* :func:`check_dataclass`: every field of a config dataclass against its annotation
  (``int``, ``float | None``, ``dict``, ...), so a field added later is checked without
  anyone remembering to: integers are not booleans, numbers are finite.
* :func:`check_known_fields`: the keys of a mapping read from outside (a JSON or TOML file, a
  recipe, an API argument) against the fields that exist; every config and record reader
  uses it, so an unknown name is reported the same way everywhere.
* :func:`short`: a value for an error message, cut to a few dozen characters (an error
  never echoes a huge value back).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import stat
from pathlib import Path

from .contained import inside
from .errors import PrunusError

MAX_SMALL_FILE_BYTES = 16 << 20  # configs, manifests, run settings, recipes: far below this
MAX_SHORT = 60


def short(value, limit: int = MAX_SHORT) -> str:
    """``repr(value)`` cut to ``limit`` characters (huge or deeply nested values are not echoed)."""
    try:
        text = repr(value) if not isinstance(value, (dict, list)) or len(value) < 50 else f"<{type(value).__name__} of {len(value)}>"
    except (RecursionError, ValueError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_text(path: str | Path, *, fix: str, max_bytes: int = MAX_SMALL_FILE_BYTES) -> str:
    """The UTF-8 text of a small file, or one PrunusError line naming it."""
    path = Path(path)
    try:
        st = path.stat()  # never open before this: opening a FIFO blocks
        if not stat.S_ISREG(st.st_mode):
            mode = st.st_mode
            what = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
            raise PrunusError(f"{path}: is {what}, not a regular file; {fix}")
        size = st.st_size
        if size > max_bytes:
            raise PrunusError(f"{path}: {size:,} bytes, above the {max_bytes:,} this file may hold; {fix}")
        data = path.read_bytes()
    except FileNotFoundError:
        raise PrunusError(f"{path}: missing; {fix}") from None
    except OSError as e:
        raise PrunusError(f"{path}: cannot be read ({e.strerror or e}); {fix}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PrunusError(f"{path}: not UTF-8 text (byte {e.start}); {fix}") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(text: str | bytes, source: str, fix: str):
    """``json.loads`` with every failure as one PrunusError line (NaN / Infinity refused)."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise PrunusError(f"{source}: not valid JSON ({e.msg} at line {e.lineno}); {fix}") from None
    except RecursionError:
        raise PrunusError(f"{source}: JSON nested too deeply; {fix}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise PrunusError(f"{source}: not valid JSON ({str(e).splitlines()[0][:100]}); {fix}") from None


def parse_document(text: str, loads, errors, source: str, kind: str):
    """``loads(text)`` for a TOML or YAML parser (``errors``: the exception types it raises on bad
    input), every failure one PrunusError line: "{source}: not valid {kind} (...); fix the file"."""
    try:
        return loads(text)
    except errors as e:
        raise PrunusError(f"{source}: not valid {kind} ({(str(e).splitlines() or [''])[0][:120]}); fix the file") from None
    except RecursionError:
        raise PrunusError(f"{source}: nested too deeply; fix the file") from None


def read_json_object(path: str | Path, *, fix: str, max_bytes: int = MAX_SMALL_FILE_BYTES) -> dict:
    """A small JSON file that must hold an object, or one PrunusError line naming it."""
    data = parse_json(read_text(path, fix=fix, max_bytes=max_bytes), str(path), fix)
    if not isinstance(data, dict):
        raise PrunusError(f"{path}: holds a JSON {type(data).__name__}, not an object; {fix}")
    return data


def read_dir_json(path: str | Path, name: str, *, no_dir: str, no_file: str, bad_json: str) -> dict:
    """``path/name`` parsed, or one PrunusError line: "{path}: {no_dir}", "{path}: {no_file}",
    or "{path/name}: not valid JSON (...); {bad_json}"."""
    path = Path(path)
    if not path.is_dir():
        raise PrunusError(f"{path}: {no_dir}")
    fpath = inside(path, name, fix=bad_json, required=False)  # a symlink out of the dir, a FIFO: one line
    if fpath is None:
        raise PrunusError(f"{path}: {no_file}")
    return read_json_object(fpath, fix=bad_json)  # UTF-8, size, JSON, an object


MAX_NODES = 100_000  # values, keys and items in one parsed recipe or config: far above any real one


def check_size(value, source: str, max_nodes: int = MAX_NODES) -> None:
    """Refuse a parsed document that expands to more than ``max_nodes`` values. YAML aliases share
    objects, so a small file can name an exponentially large value; walking it with a budget stops
    early instead of expanding it (as printing or copying it would)."""
    budget, stack = max_nodes, [value]
    while stack:
        item = stack.pop()
        budget -= 1
        if budget < 0:
            raise PrunusError(f"{source}: expands to more than {max_nodes:,} values (YAML aliases?); write it out plainly")
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


# --- dataclass fields against their annotations --------------------------------------------------

_GENERIC = re.compile(r"^(\w+)\[.*\]$")
_KINDS = {"int", "float", "bool", "str", "dict", "list", "tuple", "None"}


def _top_level_parts(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "|" and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in parts + [cur]]


def _kinds(annotation) -> set[str] | None:
    """{'int', 'None'} from 'int | None'; None when the annotation is not one this module knows."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    kinds = set()
    for part in _top_level_parts(text):
        m = _GENERIC.match(part)
        name = m.group(1) if m else part
        name = {"NoneType": "None", "Dict": "dict", "List": "list", "Tuple": "tuple"}.get(name, name)
        if name not in _KINDS:
            return None
        kinds.add(name)
    return kinds


def _fits(value, kinds: set[str]) -> bool:
    if value is None:
        return "None" in kinds
    if isinstance(value, bool):
        return "bool" in kinds
    if isinstance(value, int):  # in a float field, one a float holds exactly (2**64 is not a usable scale)
        return "int" in kinds or ("float" in kinds and abs(value) <= 2**53)
    if isinstance(value, float):
        return "float" in kinds and math.isfinite(value)
    if isinstance(value, str):
        return "str" in kinds
    if isinstance(value, dict):
        return "dict" in kinds
    if isinstance(value, (list, tuple)):
        return bool({"list", "tuple"} & kinds)
    return False


def _describe(kinds: set[str]) -> str:
    words = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string",
             "dict": "a mapping", "list": "a list", "tuple": "a list", "None": "null"}
    return " or ".join(dict.fromkeys(words[k] for k in sorted(kinds, key=lambda k: k == "None")))


def check_dataclass(obj, source: str) -> None:
    """Raise one PrunusError line when a field of dataclass instance ``obj`` does not fit its annotation."""
    for f in dataclasses.fields(obj):
        kinds = _kinds(f.type)
        if kinds is None:
            continue
        value = getattr(obj, f.name)
        if not _fits(value, kinds):
            raise PrunusError(f"{source}: {f.name}={short(value)} must be {_describe(kinds)}")


def check_known_fields(data: dict, known, source: str, *, what: str = "field", fix: str | None = None) -> None:
    """One PrunusError line naming the keys of ``data`` that are not in ``known`` (a dataclass, or names):
    "{source}: unknown {what}(s) a, b; {fix}" (default fix: the known names). At most five are named."""
    names = [f.name for f in dataclasses.fields(known)] if dataclasses.is_dataclass(known) else list(known)
    unknown = sorted(str(k) for k in data if k not in names)
    if unknown:
        listed = ", ".join(k[:MAX_SHORT] for k in unknown[:5])
        raise PrunusError(f"{source}: unknown {what}(s) {listed}; {fix or 'known: ' + ', '.join(sorted(names))}")


def dataclass_from_dict(cls, data: dict, source: str, *, what: str = "field", fix: str | None = None):
    """``cls(**data)`` for a mapping read from outside: unknown keys (:func:`check_known_fields`) and
    values that do not fit their annotation (:func:`check_dataclass`) are one line naming ``source``."""
    check_known_fields(data, cls, source, what=what, fix=fix)
    obj = cls(**data)
    check_dataclass(obj, source)
    return obj


def check_int_range(value, name: str, lo: int, hi: int, source: str = "") -> None:
    """``lo <= value <= hi`` for an integer (not a bool), else one PrunusError line."""
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        where = f"{source}: " if source else ""
        raise PrunusError(f"{where}{name} {short(value)} must be an integer from {lo} to {hi}")
