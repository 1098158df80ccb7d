"""Hugging Face safetensors checkpoints on disk: one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``, read and written tensor for tensor (never cast, so bit-exact).

Sharding follows transformers' layout: ``model-00001-of-0000N.safetensors`` files filled in
order up to ``max_shard_size`` bytes each, and an index with ``metadata.total_size`` and a
``weight_map`` from tensor name to file. A file that cannot be read (truncated, not safetensors)
is refused in one line naming it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from prunus.artifacts.errors import PrunusError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB", "500MiB", "60KB" (transformers' units)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), flags=re.IGNORECASE)
    if not m or float(m[1]) <= 0:
        raise PrunusError(f"max shard size {size!r}: give a positive size such as 5GB, 500MB or 2GiB")
    return int(float(m[1]) * UNITS[(m[2] or "").upper()])


def _load(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise PrunusError(f"{path}: missing; the checkpoint's shards are incomplete, re-download or re-save it")
    try:
        return load_file(path)
    except Exception as e:  # truncated or not safetensors: the library's message, on one line
        msg = " ".join(str(e).split()) or type(e).__name__
        raise PrunusError(f"{path}: not a readable safetensors file ({msg}); re-download or re-save it") from None


def shard_files(hf_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint dir, in the order of its index."""
    if (hf_dir / SINGLE).is_file():
        return [hf_dir / SINGLE]
    index = hf_dir / INDEX
    if not index.is_file():
        raise PrunusError(f"{hf_dir}: no {SINGLE} or {INDEX}; re-save the checkpoint with "
                          "save_pretrained(safe_serialization=True)")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = list(dict.fromkeys(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise PrunusError(f"{index}: not a safetensors index ({type(e).__name__}: {e}); re-save the checkpoint") from None
    return [hf_dir / n for n in names]


def read_weights(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint dir, by name."""
    state: dict[str, torch.Tensor] = {}
    for f in shard_files(Path(hf_dir)):
        state.update(_load(f))
    return state


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_weights(state: dict[str, torch.Tensor], out_dir: Path, max_shard_size: int | str | None = None) -> list[str]:
    """Write ``state`` into ``out_dir`` (a fresh dir) as one file, or as shards of at most
    ``max_shard_size`` bytes (a tensor larger than that gets a shard of its own) with an index.
    Returns the file names written."""
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    total = sum(_nbytes(t) for t in state.values())
    if limit is None or total <= limit:
        save_file(state, out_dir / SINGLE, metadata={"format": "pt"})
        return [SINGLE]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        if shards[-1] and size + _nbytes(t) > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += _nbytes(t)
    n = len(shards)
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, out_dir / fname, metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return files + [INDEX]
