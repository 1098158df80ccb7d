"""Any ``torch.nn.Module`` as a factory spec: ``"package.module:callable"`` plus keyword arguments.

A generic model is rebuilt by calling its factory with JSON values only (numbers, strings, booleans, null,
lists and objects of them): a model dir records the spec and the arguments in ``config.json``, never a
pickle. Importing the factory runs the code of its module, so a spec read from an artifact is imported only
when the caller trusts it (:func:`is_trusted`): the user named that factory themselves (``--model``), passed
``trust_factory=True`` / ``--trust-factory``, or listed it in ``PRUNUS_TRUST_FACTORIES`` (comma-separated
specs, matched exactly). Otherwise one line says what loading would run.

* :func:`parse_spec` checks the spec's shape before anything is imported;
* :func:`parse_model_args` reads ``--model-args k=v,k2=[1,2]`` with :func:`ast.literal_eval` (never ``eval``),
  each value a JSON value, a bare word a string;
* :func:`check_args` checks arguments given through the Python API or read from a file the same way;
* :func:`resolve_callable` imports the factory; :func:`build_module` calls it and checks that the result is an
  ``nn.Module``. Every failure is one PrunusError line naming the spec.

torch is imported only by :func:`build_module`, so the command line checks a spec and its arguments first.
"""

from __future__ import annotations

import ast
import importlib
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import check_size, short

TRUST_ENV = "PRUNUS_TRUST_FACTORIES"
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_SPEC = re.compile(rf"^({_NAME}(?:\.{_NAME})*):({_NAME}(?:\.{_NAME})*)$")
MAX_SPEC_CHARS = 300
MAX_ARGS_CHARS = 64 << 10
MAX_ARG_NODES = 10_000
MAX_DEPTH = 32


@dataclass(frozen=True)
class ModuleFactory:
    """A factory spec and its keyword arguments: what a model dir records to rebuild its module."""

    spec: str
    args: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"factory": self.spec, "args": self.args}

    def build(self, source: str = "--model"):
        """The module the factory builds (imports it: check trust first, :func:`check_trusted`)."""
        return build_module(self.spec, self.args, source=source)


def reason(e: BaseException, limit: int = 160) -> str:
    """``Type: first line of the message`` of an exception raised by the user's code, cut to ``limit``."""
    text = (str(e).strip().splitlines() or [""])[0]
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def parse_spec(spec, source: str = "--model") -> tuple[str, str]:
    """(module path, attribute path) of ``"package.module:callable"``; one line when it is not of that shape."""
    if not isinstance(spec, str) or len(spec) > MAX_SPEC_CHARS or not _SPEC.match(spec):
        raise PrunusError(f"{source} {short(spec)}: not a factory spec; write package.module:callable "
                          "(a module Python can import and a callable in it, e.g. mymodels:build)")
    module, attr = spec.split(":")
    return module, attr


def _json_value(value, where: str, depth: int = 0):
    """``value`` when it is a JSON value (finite numbers, str keys), else one line naming ``where``."""
    if depth > MAX_DEPTH:
        raise PrunusError(f"{where}: nested more than {MAX_DEPTH} deep; pass a flatter value")
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise PrunusError(f"{where}: {value} is not a finite number; pass a JSON value")
        return value
    if isinstance(value, list):
        return [_json_value(v, where, depth + 1) for v in value]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise PrunusError(f"{where}: key {short(bad[0])} is not a string; pass a JSON object")
        return {k: _json_value(v, where, depth + 1) for k, v in value.items()}
    raise PrunusError(f"{where}: {short(value)} is a {type(value).__name__}, not a JSON value (numbers, strings, "
                      "true/false, null, lists and objects of them)")


def check_args(args, source: str = "model args") -> dict:
    """``args`` checked as keyword arguments of a factory: an object of identifier -> JSON value."""
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise PrunusError(f"{source}: {short(args)} is not a mapping of argument names to values")
    check_size(args, source, MAX_ARG_NODES)
    for name in args:
        if not isinstance(name, str) or not re.fullmatch(_NAME, name):
            raise PrunusError(f"{source}: {short(name)} is not an argument name (a Python identifier)")
    return {k: _json_value(v, f"{source}: {k}") for k, v in args.items()}


def _split_top_level(text: str, source: str) -> list[str]:
    """``text`` split at the commas outside brackets and quotes."""
    parts, depth, quote, start, i = [], 0, None, 0, 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    if quote or depth:
        raise PrunusError(f"{source} {short(text)}: an unclosed {'quote' if quote else 'bracket'}; "
                          "write k=v pairs separated by commas")
    return parts + [text[start:]]


_WORDS = {"true": True, "false": False, "null": None, "none": None}


def _literal(text: str, where: str):
    """One value of ``--model-args``: a Python / JSON literal (never evaluated as code), else the bare word."""
    text = text.strip()
    if text.lower() in _WORDS:
        return _WORDS[text.lower()]
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        if re.fullmatch(r"[A-Za-z0-9_.+\-/]+", text):
            return text  # a bare word: a string
        raise PrunusError(f"{where}: {short(text)} is not a literal; quote a string, or write a number, "
                          "true/false, null, or a [list] / {object} of them") from None
    if isinstance(value, tuple):
        value = list(value)
    return _json_value(value, where)


def parse_model_args(text: str | None, source: str = "--model-args") -> dict:
    """``"num_classes=10,width=32,sizes=[8,16],act=relu"`` -> keyword arguments, each value a JSON value."""
    if text is None or not text.strip():
        return {}
    if len(text) > MAX_ARGS_CHARS:
        raise PrunusError(f"{source}: {len(text):,} characters, above {MAX_ARGS_CHARS:,}; pass fewer arguments")
    args = {}
    for part in _split_top_level(text, source):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or not re.fullmatch(_NAME, name):
            raise PrunusError(f"{source}: {short(part.strip())} is not name=value; write k=v pairs separated by commas")
        if name in args:
            raise PrunusError(f"{source}: {name} is given twice; give each argument once")
        args[name] = _literal(value, f"{source} {name}")
    return check_args(args, source)


def trusted_specs() -> set[str]:
    """The specs ``PRUNUS_TRUST_FACTORIES`` lists (comma-separated, matched exactly)."""
    return {s.strip() for s in os.environ.get(TRUST_ENV, "").split(",") if s.strip()}


def is_trusted(spec: str, trust: bool | str | Iterable[str] | None = False) -> bool:
    """Whether the caller trusts importing ``spec``: ``trust`` True, or ``spec`` among the specs ``trust``
    names (the user's own ``--model``), or among :func:`trusted_specs`."""
    if trust is True:
        return True
    named = {trust} if isinstance(trust, str) else set(trust) if trust else set()
    return spec in named or spec in trusted_specs()


def check_trusted(spec: str, trust, where: str) -> None:
    """One line unless :func:`is_trusted`: ``where`` (a model dir) names a factory whose import would run code."""
    if not is_trusted(spec, trust):
        raise PrunusError(f"{where} names the factory {spec}; loading runs that code: pass --trust-factory if you "
                          f"trust it (trust_factory=True, or list it in {TRUST_ENV})")


def resolve_callable(spec: str, source: str = "--model"):
    """The callable ``spec`` names, imported; one line when it does not import or is not callable."""
    module_name, attr = parse_spec(spec, source)
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure of the user's import is their module's, in one line
        raise PrunusError(f"{source} {spec}: importing {module_name} failed ({reason(e)}); put it on PYTHONPATH "
                          "or fix the spec") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PrunusError(f"{source} {spec}: {module_name} has no {attr}; name a callable defined in it")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PrunusError(f"{source} {spec}: {attr} is a {type(obj).__name__}, not callable; name a function or class")
    return obj


def build_module(spec: str, args: dict | None = None, source: str = "--model"):
    """``factory(**args)``, checked to be a ``torch.nn.Module``; the module carries its :class:`ModuleFactory`
    as ``prunus_factory`` (what a model dir records)."""
    import torch

    args = check_args(args, f"{source} {spec} args")
    fn = resolve_callable(spec, source)
    try:
        module = fn(**args)
    except Exception as e:  # noqa: BLE001 - the factory is the user's code: its failure is one line
        raise PrunusError(f"{source} {spec}: building the model failed ({reason(e)}); fix --model-args or the "
                          "factory") from None
    if not isinstance(module, torch.nn.Module):
        raise PrunusError(f"{source} {spec}: returned a {type(module).__name__}, not a torch.nn.Module; "
                          "return the model from the factory")
    module.prunus_factory = ModuleFactory(spec, args)
    return module
