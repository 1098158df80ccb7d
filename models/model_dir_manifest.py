"""The model dir's files and manifest, read and written without building a model: the file names, ``prunus.json``
(one writer for every model dir, transformer or generic module; its reader and the check of every file's hash)
and ``config.json``'s reader. :mod:`.model_dir` (the transformer) and :mod:`.module_dir` (any module) build on it."""

from __future__ import annotations

import datetime
import hashlib
import json
import platform
import shlex
import sys
from pathlib import Path

import torch

from prunus.artifacts.atomic import atomic_write_json
from prunus.artifacts.contained import inside
from prunus.artifacts.manifest_schema import check_manifest, sha256_file, verify_files
from prunus.artifacts.validate import read_dir_json, read_json_object

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
MANIFEST = "prunus.json"
FORMAT = "prunus-model/1"


def dir_hash(files: dict[str, str]) -> str:
    """One content hash for a dir, from the per-file hashes its manifest records."""
    return hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()


def versions() -> dict:
    import prunus

    return {"prunus": prunus.__version__, "torch": torch.__version__, "python": platform.python_version()}


def parent_entry(parent: str | Path | None) -> dict | None:
    """The manifest's ``parent``: the parent dir's path and content hash (its manifest read first), or None."""
    if parent is None:
        return None
    return {"path": str(Path(parent).resolve()), "hash": dir_hash(read_manifest(parent)["files"])}


def write_manifest(tmp: Path, *, stage: str, parent_info: dict | None, command: str | None, metrics: dict) -> dict:
    """``prunus.json`` of the model dir being written in ``tmp``: the hash of every file there, the bytes on disk,
    ``metrics``, the stage, parent, command and versions. Every model dir (transformer or generic module) is
    vouched for by this one writer."""
    files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {
        "format": FORMAT,
        "stage": stage,
        "parent": parent_info,
        "command": command if command is not None else shlex.join(sys.argv),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "files": files,
        "metrics": {"bytes_on_disk": sum((tmp / f).stat().st_size for f in files), **metrics},
        "versions": versions(),
    }
    atomic_write_json(tmp / MANIFEST, manifest)
    return manifest


def read_manifest(path: str | Path) -> dict:
    manifest = read_dir_json(path, MANIFEST, no_dir="no such model dir; give a directory written by prunus train, compress or convert",
                             no_file=f"missing {MANIFEST}; this is not a prunus model dir (for a Hugging Face dir use prunus convert --from-hf)",
                             bad_json="re-create the model dir")
    return check_manifest(manifest, path, "re-create the model dir")  # prunus.artifacts.manifest_schema


def verify_model_dir(path: str | Path) -> dict:
    """Check that every file the manifest lists exists and matches its hash; return the manifest."""
    path = Path(path)
    return verify_files(path, read_manifest(path), required=(CONFIG, WEIGHTS))  # prunus.artifacts.manifest_schema


def read_config_json(path: str | Path) -> dict:
    """The model dir's config.json as an object (a regular file inside the dir, bounded, UTF-8, JSON)."""
    cpath = inside(path, CONFIG, fix="re-create the model dir")  # a regular file inside the dir (a FIFO: one line)
    return read_json_object(cpath, fix="re-create the model dir")
