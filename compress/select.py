"""Which modules a pass touches: the one ``exclude`` rule every pass (quantize, prune) follows.

A pattern excludes a module by its exact name (``"output"``), a parent's name
(``"layers.0"``), a dotted suffix (``"w2"``: every block's ``feed_forward.w2``) or a glob
(``"layers.*.attention.wq"``). ``layers.-K`` names the K-th block from the end, so a recipe
can keep the last block in float whatever the depth (:func:`resolve_blocks`). Not given, ``exclude`` is
the output head; a pattern given that names no module of the model is refused (a misspelt name would
otherwise leave every module it meant to keep to the pass, without a word).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from prunus.artifacts.errors import PrunusError

DEFAULT_EXCLUDE = ("output",)  # what quantize and prune leave alone when not told: the output head


def exclude_list(exclude) -> list[str]:
    """``exclude`` as given by a recipe or a caller (a name, a list of names, or None) -> a list."""
    return [exclude] if isinstance(exclude, str) else list(exclude or ())


def is_excluded(name: str, exclude) -> bool:
    """``name`` matches a pattern exactly, as a dotted prefix or suffix, or by glob (see the module docstring)."""
    return any(name == p or name.startswith(p + ".") or name.endswith("." + p) or fnmatchcase(name, p)
               for p in exclude)


def resolve_blocks(model: nn.Module, exclude, where: str = "exclude") -> list[str]:
    """``exclude`` with ``layers.-K`` (and ``layers.-K.rest``) resolved to the model's K-th block from the end."""
    keys = list(getattr(model, "layers", {}) or {})
    out = []
    for p in exclude_list(exclude):
        head, _, rest = p.partition(".")
        index, _, tail = rest.partition(".")
        if head == "layers" and index.startswith("-") and index[1:].isdigit():
            k = int(index)
            if not keys or -k > len(keys):
                raise PrunusError(f"{where}: exclude {p!r}: the model has {len(keys)} blocks")
            p = f"layers.{keys[k]}" + (f".{tail}" if tail else "")
        out.append(p)
    return out


def check_named(names, patterns, resolved, label: str, where: str, what: str = "module") -> None:
    """Refuse a pattern of ``patterns`` (as given; ``resolved``: after :func:`resolve_blocks`) that matches none
    of ``names``: a misspelt name would leave the modules it meant untouched without a word."""
    names = list(names)
    for given, p in zip(exclude_list(patterns), resolved):
        if not any(is_excluded(n, [p]) for n in names):
            raise PrunusError(f"{where}: {label} {given!r} names no {what} of the model; give a module name "
                              "(output), a block (layers.0, layers.-1), a suffix (w2) or a glob (layers.*.attention.wq)")


def given_exclude(model: nn.Module, exclude, where: str) -> list[str]:
    """A pass's ``exclude``: :data:`DEFAULT_EXCLUDE` when not given (None), else the patterns given, each of
    which must name a module of the model (:func:`check_named`)."""
    if exclude is None:
        return list(DEFAULT_EXCLUDE)
    names = [n for n, _ in model.named_modules() if n]
    check_named(names, exclude, resolve_blocks(model, exclude, where), "exclude", where)
    return exclude_list(exclude)


def float_linears(model: nn.Module, exclude=(), where: str = "exclude") -> tuple[dict[str, nn.Linear], list[str]]:
    """({name: Linear} of every float ``nn.Linear`` a pass may change, [names of the float Linears it must not]).

    Excluded: the names ``exclude`` matches, and a mixture of experts' router (its few weights decide which
    experts every token goes to: rounding or zeroing them reroutes tokens)."""
    patterns = resolve_blocks(model, exclude, where)
    chosen, skipped = {}, []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and module.weight.is_floating_point():
            if is_excluded(name, patterns) or name.endswith(".router"):
                skipped.append(name)
            else:
                chosen[name] = module
    return chosen, skipped
