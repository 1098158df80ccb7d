"""A generic module's ONNX export dir (:mod:`prunus.export.module_export`) read for scoring: its files checked
against its manifest (:func:`prunus.runtime.artifact.verify_export_dir`), its graph run in ONNX Runtime behind
the ``nn.Module`` interface the trainer's scoring calls (:class:`OnnxModule`). Nothing in the dir is imported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from prunus.artifacts.errors import PrunusError

# ONNX Runtime's input type -> the numpy dtype a batch is fed as
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}


def is_module_export(path: str | Path) -> bool:
    """Whether ``path``'s config.json is a generic module's export (kind "module" with an ``export`` key)."""
    from prunus.models.model_dir import read_config_json

    try:
        config = read_config_json(path)
    except PrunusError:
        return False
    return config.get("kind") == "module" and isinstance(config.get("export"), dict)


def read_module_export(path: Path) -> tuple[dict, dict, Path]:
    """(config.json, the manifest, the graph's path inside the dir), every file checked against the manifest."""
    from prunus.runtime.artifact import export_graph_paths, read_artifact_config, verify_export_dir

    config = read_artifact_config(path)
    export = config.get("export")
    if config.get("kind") != "module" or not isinstance(export, dict) or export.get("graph") != "module":
        raise PrunusError(f"{path}: not a generic module's export dir (config.json kind module, export.graph module); "
                          "give one written by prunus export from a generic model dir")
    if export.get("format") != "onnx":
        raise PrunusError(f"{path}: a {export.get('format')!r} export; prunus eval scores ONNX export dirs")
    manifest = verify_export_dir(path, export)
    graph = export_graph_paths(path, export, names=("model",))["model"]
    return config, manifest, graph


class OnnxModule(torch.nn.Module):
    """The graph at ``graph`` in ONNX Runtime (CPU), called as the module it was exported from: a batch tensor in,
    the output tensor out. A batch the graph refuses raises ValueError (the trainer's misfit types)."""

    def __init__(self, graph: Path, threads: int | None = None):
        super().__init__()
        from prunus.runtime.ort_session import ort_session

        try:
            self.session = ort_session(graph, threads)
        except PrunusError:
            raise
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types for an unreadable graph
            first = (str(e).splitlines() or [""])[0][:200]
            raise PrunusError(f"{graph}: ONNX Runtime cannot load it ({type(e).__name__}: {first}); re-create the "
                              "export dir with prunus export") from None
        spec = self.session.get_inputs()[0]
        self.input, self.dtype = spec.name, _ORT_TYPES.get(spec.type, np.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = np.ascontiguousarray(x.detach().cpu().numpy().astype(self.dtype, copy=False))
        try:
            out = self.session.run(None, {self.input: batch})[0]
        except Exception as e:  # noqa: BLE001 - onnxruntime's own types for a shape or type it does not take
            first = (str(e).splitlines() or [""])[0]
            raise ValueError(first[-200:]) from None
        return torch.from_numpy(np.asarray(out))
