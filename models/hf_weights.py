"""Hugging Face safetensors checkpoints on disk: one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``, read and written tensor for tensor (never cast, so bit-exact).

Sharding follows transformers' layout: ``model-00001-of-0000N.safetensors`` files filled in
order up to ``max_shard_size`` bytes each, and an index with ``metadata.total_size`` and a
``weight_map`` from tensor name to file. A file that cannot be read (truncated, not safetensors),
an index entry that names anything but a regular file inside the dir (``../x``, an absolute path,
a symlink out, a FIFO) and a tensor holding NaN or infinity are refused in one line naming them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from prunus.artifacts.contained import inside
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.safetensors_header import read_header
from prunus.artifacts.validate import read_json_object, short

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


FIX = "re-download or re-save the checkpoint"
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _load(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, each checked to hold no NaN or infinity as it is read."""
    try:
        state = load_file(path)
    except Exception as e:  # truncated or not safetensors: the library's message, on one line
        msg = " ".join(str(e).split()) or type(e).__name__
        raise PrunusError(f"{path}: not a readable safetensors file ({msg}); {FIX}") from None
    for name, t in state.items():
        if t.dtype in FLOATS and not bool(torch.isfinite(t).all()):
            raise PrunusError(f"{path}: tensor {short(name)} holds NaN or infinite values; the checkpoint is damaged, "
                              f"{FIX}")
    return state


def _weight_map(hf_dir: Path) -> dict:
    """The index's ``weight_map`` (tensor name -> shard file name), every value a string."""
    index = hf_dir / INDEX
    data = read_json_object(index, fix=FIX)  # bounded, UTF-8, JSON: one line on any failure
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise PrunusError(f"{index}: weight_map is {short(weight_map)}, not an object of tensor name -> file; "
                          "re-save the checkpoint")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise PrunusError(f"{index}: weight_map[{short(name)}] is {short(file)}, not a file name; "
                              "re-save the checkpoint")
    return weight_map


def shard_files(hf_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint dir, in the order of its index; each a regular file inside the
    dir (prunus.artifacts.contained: an index naming ``../x``, ``/etc/passwd`` or a symlink out is refused)."""
    single = inside(hf_dir, SINGLE, fix=FIX, required=False)
    if single is not None:
        return [single]
    if inside(hf_dir, INDEX, fix=FIX, required=False) is None:
        raise PrunusError(f"{hf_dir}: no {SINGLE} or {INDEX}; re-save the checkpoint with "
                          "save_pretrained(safe_serialization=True)")
    files: dict[str, Path] = {}
    for name, file in _weight_map(hf_dir).items():
        if file not in files:
            files[file] = inside(hf_dir, file, f"{hf_dir / INDEX}: weight_map[{short(name)}]", fix=FIX)
    return list(files.values())


def read_headers(files: list[Path]) -> dict[str, dict]:
    """Tensor name -> safetensors header entry (dtype, shape, offsets) over every file, nothing but headers read."""
    headers: dict[str, dict] = {}
    for f in files:
        headers.update(read_header(f, fix=FIX))
    return headers


def read_weights(hf_dir: str | Path, files: list[Path] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint dir (of ``files``, from :func:`shard_files`), by name."""
    state: dict[str, torch.Tensor] = {}
    for f in files if files is not None else shard_files(Path(hf_dir)):
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
