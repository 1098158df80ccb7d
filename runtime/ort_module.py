"""A generic module's ONNX export dir (:mod:`prunus.export.module_export`: one graph with a dynamic batch axis)
served by ONNX Runtime: ``predict(batch)`` is one ``session.run``. No factory is imported. A graph ONNX Runtime
cannot read, or whose initializers hold NaN or infinity (:mod:`prunus.artifacts.onnx_initializers`), is one line."""

from __future__ import annotations

import numpy as np

from prunus.artifacts.errors import PrunusError

from .artifact import export_graph_paths
from .ort_session import ort_session
from .predict_backend import PredictBackend, check_predict_options
from .registry import Loaded


class OrtModuleBackend(PredictBackend):
    name = "onnxruntime"

    def __init__(self, path, config: dict, options):
        graph = export_graph_paths(path, config["export"], names=("model",))["model"]
        try:
            self.session = ort_session(graph, options.threads)
        except PrunusError:
            raise
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types for unreadable / invalid graphs
            raise PrunusError(f"{graph}: ONNX Runtime cannot load it ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''}); re-create the export dir with "
                              "prunus export") from None
        self._input = self.session.get_inputs()[0].name
        super().__init__(path, config, options.max_batch)

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self._input: batch})[0]

    def close(self) -> None:
        self.session = None


def load(path, config: dict, options) -> Loaded:
    check_predict_options(path, options)
    backend = OrtModuleBackend(path, config, options)
    return Loaded(backend, None, {"task": config.get("task"), "graph": config["export"]["graphs"]["model"]})
