"""What a generic module dir holds, read without importing its factory: what ``prunus info`` shows.

:func:`module_summary` reads ``config.json`` (checked), the manifest and the weights' safetensors header (bounded
and validated; no tensor is read): the factory spec and its arguments, the task, the input spec, the parameter
count (the manifest's, else the header's elements) and the lineage: this dir's stage and command, then each
parent the manifest names, followed while it is a readable model dir (at most :data:`MAX_LINEAGE` steps).
"""

from __future__ import annotations

import json
from pathlib import Path

from prunus.artifacts.contained import inside
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.safetensors_header import read_header

from .module_dir import FIX, read_module_config

MAX_LINEAGE = 16


def lineage(path: str | Path, manifest: dict) -> list[dict]:
    """``[{stage, path, hash, command}]`` from ``path`` up through its parents (a parent that is gone or unreadable
    ends the list with what the child's manifest says of it)."""
    from .model_dir import read_manifest

    out = [{"stage": manifest.get("stage"), "path": str(path), "command": manifest.get("command")}]
    parent = manifest.get("parent")
    while isinstance(parent, dict) and len(out) <= MAX_LINEAGE:
        entry = {"path": parent.get("path"), "hash": str(parent.get("hash", ""))[:12]}
        try:
            manifest = read_manifest(parent.get("path"))
        except (PrunusError, TypeError, OSError):
            out.append({**entry, "stage": "(not readable)"})
            break
        out.append({**entry, "stage": manifest.get("stage"), "command": manifest.get("command")})
        parent = manifest.get("parent")
    return out


def module_summary(path: str | Path) -> dict:
    """{factory, args, task, input, params, stored_tensors, pruned_shapes, manifest, lineage} of the generic
    module dir at ``path``; nothing of it is imported or executed."""
    from .model_dir import WEIGHTS, read_manifest

    path = Path(path)
    manifest = read_manifest(path)
    config = read_module_config(path)
    header = read_header(inside(path, WEIGHTS, fix=FIX), fix=FIX)  # a regular file inside the dir
    elements = 0
    for entry in header.values():
        n = 1
        for d in entry["shape"]:
            n *= d
        elements += n
    params = manifest.get("metrics", {}).get("params", elements)
    return {"factory": config["factory"], "args": config.get("args", {}), "task": config.get("task") or "-",
            "input": config.get("input"), "params": params, "stored_tensors": f"{len(header):,} ({elements:,} values)",
            "pruned_shapes": len(config.get("pruned_shapes") or {}), "manifest": manifest,
            "lineage": lineage(path, manifest)}


def input_text(spec: dict | None) -> str:
    """``float32 [3, 32, 32]`` (``, values < high`` for integer inputs), or ``-``."""
    if not spec:
        return "-"
    text = f"{spec['dtype']} {json.dumps(spec['shape'])}"
    return text + (f", values < {spec['high']:,}" if spec.get("high") is not None else "")
