"""The ONNX Runtime backend: an export dir's prefill/decode graphs in two CPU sessions, or its genai graph
(one session, a shared KV buffer: :mod:`prunus.serve.backend_ort_genai`) where config.json's ``export.graph``
says "genai"."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from prunus.artifacts.errors import PrunusError

from .artifact import check_graph_kind, export_dims, export_graph_paths
from .backend_graph import GraphBackend

PRECISION_DTYPE = {"fp32": torch.float32, "int8": torch.float32, "fp8": torch.float32, "fp16": torch.float16}


class OrtRunner:
    def __init__(self, graphs: dict[str, Path], threads: int | None = None):
        try:
            from prunus.export.ort_graphs import ort_session
        except ImportError as e:
            raise PrunusError(f"the onnxruntime backend needs onnxruntime ({e}); pip install onnxruntime") from None
        self.sessions = {}
        for kind, path in graphs.items():
            try:
                self.sessions[kind] = ort_session(path, threads)
            except Exception as e:  # onnxruntime raises its own types for unreadable / invalid graphs
                raise PrunusError(f"{path}: ONNX Runtime cannot load it ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                                  "re-create the export dir with prunus export") from None
            check_graph_kind(kind, [i.name for i in self.sessions[kind].get_inputs()], path)  # not swapped

    def run(self, graph: str, feeds: dict[str, torch.Tensor], outputs: list[str]) -> list[torch.Tensor]:
        arrays = {k: np.ascontiguousarray(v.numpy()) for k, v in feeds.items()}
        return [torch.from_numpy(o) for o in self.sessions[graph].run(outputs, arrays)]

    def close(self) -> None:
        self.sessions.clear()


def load_onnxruntime_backend(path: Path, config: dict, n_slots: int, max_len: int, threads: int | None = None,
                             prompt_graph: bool = False, native: bool = False):
    """A :class:`GraphBackend` over the torch-exported prefill / decode graphs, or for an export dir holding the
    genai graph (``export.graph == "genai"``) a :class:`prunus.serve.backend_ort_genai.GenaiBackend`
    (``prompt_graph``: with its prompt twin; ``native``: decode in prunus's own kernels; see
    :class:`prunus.export.genai_session.GenaiSession`)."""
    export = config["export"]
    if export.get("graph") == "genai":
        from .backend_ort_genai import load_genai_backend

        return load_genai_backend(path, config, n_slots, max_len, threads, prompt_graph, native)
    for wanted, flag in ((prompt_graph, "--prompt-graph"), (native, "--native")):
        if wanted:
            raise PrunusError(f"{path}: {flag} needs a genai export (this one holds the torch graphs); "
                              "re-export with --graph genai or drop it")
    graphs = export_graph_paths(path, export, nested="onnx" if export.get("format") == "tensorrt" else None)
    dims = export_dims(path, export)
    dtype = PRECISION_DTYPE.get(export.get("precision", "fp32"), torch.float32)
    return GraphBackend(OrtRunner(graphs, threads), **dims, n_slots=n_slots, max_len=max_len, dtype=dtype,
                        name="onnxruntime")
