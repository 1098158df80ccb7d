"""What a path holds (a model dir or an export dir) and which backend serves it.

A model dir (``prunus train``, ``compress``, ``convert``) is served by the torch
backend; an export dir carries an ``"export"`` key in its config.json whose
``format`` names its runtime: ``onnx`` → onnxruntime, ``tensorrt`` → tensorrt.

An export dir is checked like a model dir before it is used: every file its manifest
lists must be inside the dir with its hash, the graphs config.json names among them
(:func:`verify_export_dir`); and each graph must be the kind its name says
(:func:`check_graph_kind`: only decode takes the past keys and values).
"""

from __future__ import annotations

from pathlib import Path

from prunus.artifacts.contained import inside
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.manifest_schema import MANIFEST, verify_files
from prunus.artifacts.validate import read_dir_json, short

from .backend_names import BACKENDS, EXPORT_BACKEND


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
    if export is not None:
        verify_export_dir(path, export)  # like a model dir's: every file against the manifest
    return backend, config


def _graph_files(export: dict) -> list:
    graphs = export.get("graphs")
    if not isinstance(graphs, dict):
        return []
    names = []
    for value in graphs.values():
        names += list(value.values()) if isinstance(value, dict) else [value]
    return names


def verify_export_dir(path: str | Path, export: dict) -> dict:
    """The export dir's manifest checked against its files (hashes, names inside the dir) and naming the
    graphs config.json points to; returns the manifest."""
    path = Path(path)
    if not isinstance(export, dict):
        raise PrunusError(f"{path}/config.json: 'export' is not an object; re-create the export dir")
    manifest = read_dir_json(path, MANIFEST, no_dir="no such directory; give an export dir",
                             no_file=f"missing {MANIFEST}; re-create the export dir with prunus export",
                             bad_json="re-create the export dir")
    graphs = _graph_files(export)
    if not graphs or not all(isinstance(g, str) for g in graphs):
        raise PrunusError(f"{path}/config.json: export.graphs {short(export.get('graphs'))} does not name the graph "
                          "files; re-create the export dir")
    return verify_files(path, manifest, required=("config.json", *graphs), kind="export dir")


def check_graph_kind(kind: str, input_names: list[str], path: str | Path) -> None:
    """A decode graph takes the past keys and values, a prefill graph does not: two swapped files are one line."""
    takes_past = any(n.startswith("past.") for n in input_names)
    if kind in ("prefill", "decode") and takes_past != (kind == "decode"):
        other = "decode" if kind == "prefill" else "prefill"
        raise PrunusError(f"{path}: is a {other} graph where the {kind} graph belongs (inputs {short(input_names)}); "
                          "re-create the export dir with prunus export")


def export_graph_paths(path: Path, export: dict, names: tuple[str, ...] = ("prefill", "decode"),
                       nested: str | None = None) -> dict[str, Path]:
    """The graph files config.json's ``export.graphs`` names (``nested``: under that key, as a TensorRT
    dir keeps its ONNX graphs), each checked to exist."""
    graphs = export.get("graphs") or {}
    if nested:
        graphs = graphs.get(nested) or {}
    paths = {}
    for kind in names:
        if kind not in graphs:
            raise PrunusError(f"{path}/config.json: export.graphs has no {kind!r} entry; re-create the export dir")
        paths[kind] = inside(path, graphs[kind], f"{path}/config.json: export.graphs[{kind!r}]",
                             fix="re-create the export dir with prunus export")  # never a file outside the dir
    return paths


def export_dims(path: Path, export: dict) -> dict[str, int]:
    """The cache and logits dimensions an export dir's config.json records, for the graph backend."""
    try:
        return {k: int(export[k]) for k in ("n_layers", "n_kv_heads", "head_dim", "vocab_size")}
    except (KeyError, TypeError, ValueError):
        raise PrunusError(f"{path}/config.json: export needs n_layers, n_kv_heads, head_dim and vocab_size; "
                          "re-create the export dir") from None


def export_tokenizer(path: Path, config: dict):
    """An export dir's tokenizer, checked against the vocabulary its graphs were written for."""
    from prunus.models import load_tokenizer
    from prunus.models.tokenizer import check_vocab

    tokenizer = load_tokenizer(config.get("tokenizer"), base_dir=path)
    check_vocab(tokenizer, config["model"]["vocab_size"], path)
    return tokenizer
