"""Tensor parallelism for any ``nn.Module`` by the user's plan: ``--tp 2 --tp-plan plan.json``.

The plan is a JSON object of module name -> ``"colwise"`` or ``"rowwise"`` (e.g. ``{"fc1": "colwise", "fc2":
"rowwise"}``), applied with ``torch.distributed.tensor.parallel.parallelize_module``: a column-parallel Linear
keeps its output sharded on the feature axis, the row-parallel one after it takes that shard and all-reduces
its output, so the module's output is whole on every rank (Megatron's pairing). Every name must be an
``nn.Linear`` of the module whose sharded width ``--tp`` divides; anything else is one line naming the plan's
entry. After the plan is applied, one sample's output must keep the shape the whole module gives.
"""

from __future__ import annotations

from pathlib import Path

import torch

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import read_json_object, short

STYLES = ("colwise", "rowwise")
MAX_ENTRIES = 10_000
FIX = "write the plan as {\"module name\": \"colwise\" | \"rowwise\"} naming nn.Linear modules"


def read_tp_plan(path: str | Path) -> dict[str, str]:
    """The plan file, bounded and checked for its form (not yet against a module)."""
    plan = read_json_object(path, fix=FIX)
    if not plan or len(plan) > MAX_ENTRIES:
        raise PrunusError(f"--tp-plan {path}: holds {len(plan)} entries; {FIX}")
    for name, style in plan.items():
        if style not in STYLES:
            raise PrunusError(f"--tp-plan {path}: entry {short(name)} is {short(style)}, not colwise or rowwise")
    return plan


def check_tp_plan(module: torch.nn.Module, plan: dict[str, str], tp: int, source: str) -> None:
    """One line unless every entry names an nn.Linear of ``module`` whose sharded width ``tp`` divides."""
    modules = dict(module.named_modules())
    for name, style in plan.items():
        target = modules.get(name) if name else None
        if target is None:
            raise PrunusError(f"--tp-plan {source}: entry {short(name)} is not a module of {type(module).__name__}; "
                              "name modules as model.named_modules() does, e.g. layer1.0.fc")
        if type(target) is not torch.nn.Linear:
            raise PrunusError(f"--tp-plan {source}: entry {short(name)} is a {type(target).__name__}, not an "
                              "nn.Linear; a plan shards Linear layers only")
        width = target.out_features if style == "colwise" else target.in_features
        if width % tp:
            raise PrunusError(f"--tp-plan {source}: entry {short(name)} ({style}) has {width} "
                              f"{'outputs' if style == 'colwise' else 'inputs'}, not divisible by --tp {tp}")


def apply_tp_plan(module: torch.nn.Module, plan: dict[str, str], tp_mesh, forward) -> torch.nn.Module:
    """``module`` sharded in place over ``tp_mesh`` by ``plan`` (checked first), its output shape verified by
    ``forward(module)`` (the module on one batch's input) before and after."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with torch.no_grad():
        was = module.training
        module.eval()
        whole = forward(module).shape
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(module, tp_mesh, {name: styles[style]() for name, style in plan.items()})
        sharded = forward(module).shape
        module.train(was)
    if sharded != whole:
        raise PrunusError(f"--tp-plan: the module's output has shape {tuple(sharded)} under the plan but "
                          f"{tuple(whole)} whole; follow every colwise Linear by a rowwise one before the output")
    return module
