"""What an export dir records about itself: its manifest (``prunus.json``: stage "export", the parent model dir's
path and hash, the command, file hashes, metrics repeated from the parity report) and the result an export returns."""

from __future__ import annotations

import datetime
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from prunus.artifacts.atomic import atomic_write_json
from prunus.models.model_dir import MANIFEST, dir_hash, sha256_file, versions

FORMAT = "prunus-export/1"
PARITY = "parity.json"
PARITY_METRICS = ("max_abs_logits", "top1_agreement", "bpb_torch", "bpb_onnx", "bpb_increase", "greedy_agreement",
                  "decode_agreement", "passed")


@dataclass
class ExportResult:
    path: Path
    config: dict
    parity: dict


def write_manifest(tmp: Path, model_dir: Path, parent_manifest: dict, report: dict, command: str | None,
                   keys: tuple[str, ...] = PARITY_METRICS) -> None:
    """The export dir's prunus.json; ``keys``: the parity report's figures its metrics repeat."""
    files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST}
    metrics = {k: report[k] for k in keys if k in report}
    metrics["bytes_on_disk"] = sum((tmp / f).stat().st_size for f in files)
    metrics["graph_bytes"] = sum((tmp / f).stat().st_size for f in files if ".onnx" in f)
    atomic_write_json(tmp / MANIFEST, {
        "format": FORMAT,
        "stage": "export",
        "parent": {"path": str(model_dir.resolve()), "hash": dir_hash(parent_manifest["files"])},
        "command": command if command is not None else shlex.join(sys.argv),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "files": files,
        "metrics": metrics,
        "versions": {**versions(), **_onnx_versions()},
    })


def _onnx_versions() -> dict:
    import onnx
    import onnxruntime

    return {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}
