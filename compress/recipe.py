"""Recipes: which passes run, in which order, with which arguments.

A recipe is YAML::

    passes:
      - smoothquant: {alpha: 0.5}
      - quantize: {scheme: w8a8-static, calibration: percentile}

Each entry names a pass of the registry below (a bare name runs it with its
defaults). A recipe is checked whole before any pass runs: an unknown pass, an
unknown or missing argument, a bad value (``pass_arguments.py``: numbers finite and in range) or an
argument that would change nothing is one PrunusError naming the entry.
Recipes shipped with prunus live in ``compress/recipes/`` and can be named without
a path (``--recipe int8-weight-only``). The CLI shortcuts (``--quantize``, ``--prune``,
``--distill``) build the same list.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from pathlib import Path

import yaml

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import check_dataclass, check_size, parse_document, read_text, short

from .options import STRUCTURED_TARGETS
from .pass_arguments import APPLIES, VALUE_CHECKS, overlapping_lists

MAX_RECIPE_BYTES = 1 << 20

RECIPES_DIR = Path(__file__).parent / "recipes"


@dataclasses.dataclass(frozen=True)
class PassEntry:
    """One pass of the registry: where its function is (imported when a recipe uses it) and what the runner
    gives it besides the recipe's arguments."""

    target: str  # "module:function"
    shows_progress: bool = False  # it draws its own progress (distillation trains) and takes ``progress``
    kinds: tuple = ("transformer",)  # the model kinds (prunus.models.spec) it applies to


PASSES = {
    "quantize": PassEntry("prunus.compress.quantize:quantize_pass"),
    "smoothquant": PassEntry("prunus.compress.smoothquant:smoothquant_pass"),
    "prune": PassEntry("prunus.compress.prune:prune_pass"),
    "prune_structured": PassEntry("prunus.compress.prune_structured:prune_structured_pass"),
    "distill": PassEntry("prunus.compress.distill:distill_pass", shows_progress=True),
    # generic modules (prunus.compress.module_compress)
    "prune_channels": PassEntry("prunus.compress.module_prune:prune_channels_pass", kinds=("module",)),
    "distill_module": PassEntry("prunus.compress.module_distill:distill_module_pass", kinds=("module",)),
}


def get_pass(name: str, where: str = "recipe"):
    """The function registered as ``name``."""
    if name not in PASSES:
        raise PrunusError(f"{where}: unknown pass {short(name)}; known passes: {', '.join(PASSES)}")
    module, func = PASSES[name].target.split(":")
    try:
        return getattr(importlib.import_module(module), func)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise PrunusError(f"{where}: pass {name!r} is not available in this install ({module} is missing)") from None


def pass_parameters(name: str, args: dict, where: str = "recipe") -> tuple[dict[str, inspect.Parameter], str]:
    """(name -> parameter of each argument pass ``name`` takes with ``args``, what picked them, for messages).

    A pass that dispatches on an argument declares how (``fn.dispatch(args)``: the function that takes the
    rest, or None while that argument is unknown): ``quantize`` takes ``scheme`` and the arguments of that
    scheme's pass. Its own arguments are checked first, so a bad scheme is named before the rest. The
    ``progress`` of a pass that draws its own is the runner's to give, never a recipe's."""
    fn = get_pass(name, where)
    runner = {"progress"} if PASSES[name].shows_progress else set()
    params = {k: p for k, p in list(inspect.signature(fn).parameters.items())[2:]  # after (model, ctx)
              if p.kind is not inspect.Parameter.VAR_KEYWORD and k not in runner}
    dispatch = getattr(fn, "dispatch", None)
    if dispatch is None:
        return params, ""
    _check_values(name, params, {k: v for k, v in args.items() if k in params}, where)
    own = list(params)
    params.update({k: p for k, p in list(inspect.signature(dispatch(args)).parameters.items())[2:] if k not in params})
    return params, " for " + ", ".join(f"{k} {args[k]}" for k in own if k in args)


def _check_values(name: str, params: dict, args: dict, where: str) -> None:
    missing = [k for k in params if params[k].default is inspect.Parameter.empty and k not in args]
    if missing:
        raise PrunusError(f"{where}: pass {name!r} needs {', '.join(missing)}")
    for key, value in args.items():
        check = VALUE_CHECKS.get((name, key))
        if check is None:
            continue
        try:
            ok, why = check[0](value), f"; use {check[1]}"
        except ValueError as e:  # the check says what is wrong
            ok, why = False, f": {e}"
        if not ok:
            raise PrunusError(f"{where}: {name}.{key}={short(value)} is not valid{why}")


def _check_applies(name: str, params: dict, args: dict, where: str) -> None:
    """Refuse an argument given where it does nothing (:data:`APPLIES`), and a quantize module listed both in
    ``int8`` and in ``exclude``."""
    full = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty} | args
    for key in args:
        rule = APPLIES.get((name, key))
        if rule is not None and not rule[0](full):
            raise PrunusError(f"{where}: {name}.{key} acts only with {rule[1]}, so here it would change nothing; drop it")
    both = overlapping_lists(name, args)
    if both:
        raise PrunusError(f"{where}: {name} lists {', '.join(both)} both in int8 and in exclude; keep each module in "
                          "one list (int8: quantized to int8, exclude: left in float)")


def check_pass(name: str, args: dict, where: str = "recipe") -> None:
    """Raise a PrunusError for an unknown pass, an unknown or missing argument, a bad value or an argument that
    would change nothing: each argument must fit the type the pass function declares for it (``int``,
    ``float | None``, ``str | list``, ...), the range :data:`VALUE_CHECKS` gives and the other arguments
    (:data:`APPLIES`), so every recipe is checked whole before any pass runs."""
    if not isinstance(args, dict):
        raise PrunusError(f"{where}: the arguments of {name!r} must be a mapping (name: value), not {type(args).__name__}")
    params, picked = pass_parameters(name, args, where)
    for key in args:
        if key not in params:
            raise PrunusError(f"{where}: pass {name!r} has no argument {short(key)}{picked}; "
                              f"its arguments: {', '.join(params)}")
    _check_values(name, params, args, where)
    # every argument, checked or not above, against the type the pass declares for it
    typed = dataclasses.make_dataclass(f"{name}_arguments", [(k, params[k].annotation) for k in args])
    check_dataclass(typed(**args), f"{where}: {name}")
    _check_applies(name, params, args, where)


def parse_recipe(data, source: str = "recipe") -> list[tuple[str, dict]]:
    """A parsed YAML document (or its text) -> [(pass name, arguments)], checked."""
    if isinstance(data, str):
        data = parse_document(data, yaml.safe_load, yaml.YAMLError, source, "YAML")
    check_size(data, source)  # prunus.artifacts.validate: YAML aliases can name an exponentially large value
    if not isinstance(data, dict) or not isinstance(data.get("passes"), list) or not data["passes"]:
        raise PrunusError(f"{source}: needs a non-empty 'passes:' list (e.g. passes: [{{quantize: {{scheme: int8-weight-only}}}}])")
    extra = sorted(set(data) - {"passes", "description"})
    if extra:
        raise PrunusError(f"{source}: unknown key(s) {', '.join(extra)}; a recipe has 'passes' and optionally 'description'")
    passes = []
    for i, entry in enumerate(data["passes"], 1):
        where = f"{source}: pass {i}"
        if isinstance(entry, str):
            name, args = entry, {}
        elif isinstance(entry, dict) and len(entry) == 1:
            name, args = next(iter(entry.items()))
            args = {} if args is None else args
        else:
            raise PrunusError(f"{where}: write each pass as 'name' or 'name: {{argument: value}}'")
        check_pass(name, args, where)
        passes.append((name, dict(args)))
    return passes


def recipe_path(recipe: str | Path) -> Path:
    """A recipe file, or the name of a recipe shipped with prunus."""
    path = Path(recipe)
    if path.is_file():
        return path
    shipped = RECIPES_DIR / f"{recipe}.yaml"
    if path.suffix == "" and shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
    raise PrunusError(f"recipe {recipe}: no such file; give a YAML file or one of the shipped recipes: {names}")


def load_recipe(recipe: str | Path) -> tuple[list[tuple[str, dict]], str]:
    """(checked passes, the recipe's text) from a file or a shipped recipe's name."""
    path = recipe_path(recipe)
    text = read_text(path, fix="give a recipe YAML file", max_bytes=MAX_RECIPE_BYTES)
    return parse_recipe(text, source=str(path)), text


def shortcut_passes(*, quantize: str | None = None, prune: str | None = None, distill: str | None = None) -> list[tuple[str, dict]]:
    """The CLI shortcuts as passes, in pipeline order: distill, prune, quantize.

    ``--prune METHOD[:AMOUNT]``: magnitude / wanda with a sparsity (default 0.5), 2:4 or
    2:4-magnitude, or a structured target heads / channels (a fraction) or blocks (a count).
    """
    passes = []
    if distill is not None:
        passes.append(("distill", {"student": distill}))
    if prune is not None:
        passes.append(_prune_shortcut(prune))
    if quantize is not None:
        passes.append(("quantize", {"scheme": quantize}))
    for name, args in passes:
        check_pass(name, args, where=f"--{name.split('_')[0]}")
    return passes


def _prune_shortcut(spec: str) -> tuple[str, dict]:
    if spec in ("2:4", "2:4-magnitude"):
        return "prune", {"method": spec}
    method, _, amount = spec.partition(":")
    value = None
    if amount:
        try:
            value = int(amount) if method == "blocks" else float(amount)
        except ValueError:
            what = "a whole number of blocks" if method == "blocks" else "a number"
            raise PrunusError(f"--prune {spec}: {amount!r} is not {what}; write METHOD[:AMOUNT], e.g. wanda:0.5") from None
    if method in STRUCTURED_TARGETS:
        if value is None:
            raise PrunusError(f"--prune {spec}: give how much to remove, e.g. {method}:{1 if method == 'blocks' else 0.25}")
        return "prune_structured", {"target": method, "amount": value}
    if method in ("magnitude", "wanda"):
        return "prune", {"method": method, **({"sparsity": value} if value is not None else {})}
    raise PrunusError(f"--prune {spec}: unknown method; use magnitude[:S], wanda[:S], 2:4, 2:4-magnitude, "
                      f"heads:F, channels:F or blocks:N")


def recipe_yaml(passes: list[tuple[str, dict]]) -> str:
    """The passes written back as a recipe (what ran, for the output dir)."""
    return yaml.safe_dump({"passes": [{name: args} for name, args in passes]}, sort_keys=False)
