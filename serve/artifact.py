"""What a path holds (a model dir or an export dir) and which backend serves it.

A model dir (``prunus train``, ``compress``, ``convert``) is served by the torch
backend; an export dir carries an ``"export"`` key in its config.json whose
``format`` names its runtime: ``onnx`` → onnxruntime, ``tensorrt`` → tensorrt.
"""

from __future__ import annotations

from pathlib import Path

from prunus.models import PrunusError
from prunus.models.model_dir import read_dir_json

BACKENDS = ("torch", "onnxruntime", "tensorrt")
EXPORT_BACKEND = {"onnx": "onnxruntime", "tensorrt": "tensorrt"}


def read_artifact_config(path: str | Path) -> dict:
    return read_dir_json(path, "config.json", no_dir="no such directory; give a model dir or an export dir",
                         no_file="no config.json; give a model dir (prunus train/compress) or an export dir (prunus export)",
                         bad_json="re-create the dir")


def resolve_backend(path: str | Path, backend: str | None) -> tuple[str, dict]:
    """(backend name, config.json) for ``path``; ``backend=None`` picks the one the artifact needs."""
    config = read_artifact_config(path)
    export = config.get("export")
    if export is not None:
        fmt = export.get("format")
        if fmt not in EXPORT_BACKEND:
            raise PrunusError(f"{path}/config.json: unknown export format {fmt!r}; expected one of {', '.join(EXPORT_BACKEND)}")
        needed = EXPORT_BACKEND[fmt]
    else:
        needed = "torch"
    backend = backend or needed
    if backend not in BACKENDS:
        raise PrunusError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    if backend != needed:
        what = f"an export dir in {export['format']} format" if export is not None else "a model dir (PyTorch weights)"
        hint = f"use --backend {needed}" + ("" if export is not None else ", or export it first with prunus export")
        raise PrunusError(f"{path}: the {backend} backend cannot load {what}; {hint}")
    return backend, config
