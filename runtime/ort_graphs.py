"""The ONNX Runtime graphs runtime: an export dir's prefill / decode graphs (``torch.onnx.export``'s) in two CPU
sessions, batched by :class:`prunus.runtime.graph_backend.GraphBackend`. A genai export (one graph, a shared KV
buffer) is :mod:`prunus.runtime.ort_genai`'s.

A TensorRT dir's ONNX graphs run with their float semantics (:data:`TENSORRT_SEMANTICS`), as TensorRT computes
them, so that what ONNX Runtime serves and checks of such a dir is what its engines compute."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from prunus.artifacts.errors import PrunusError

from .artifact import check_graph_kind, export_dims, export_graph_paths, export_tokenizer
from .graph_backend import GraphBackend
from .load_options import LoadOptions
from .registry import Loaded

# DequantizeLinear -> MatMul as written: ONNX Runtime's default rewrite into MatMulNBits at accuracy level 4 would
# quantize the activations to int8, which TensorRT does not
TENSORRT_SEMANTICS = {"session.qdq_matmulnbits_accuracy_level": "0"}
PRECISION_DTYPE = {"fp32": torch.float32, "int8": torch.float32, "fp8": torch.float32, "fp16": torch.float16}


class OrtRunner:
    def __init__(self, graphs: dict[str, Path], threads: int | None = None, config: dict | None = None):
        try:
            from .ort_session import ort_session
        except ImportError as e:
            raise PrunusError(f"the onnxruntime backend needs onnxruntime ({e}); pip install onnxruntime") from None
        self.sessions = {}
        for kind, path in graphs.items():
            try:
                self.sessions[kind] = ort_session(path, threads, config=config)
            except Exception as e:  # onnxruntime raises its own types for unreadable / invalid graphs
                raise PrunusError(f"{path}: ONNX Runtime cannot load it ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                                  "re-create the export dir with prunus export") from None
            check_graph_kind(kind, [i.name for i in self.sessions[kind].get_inputs()], path)  # not swapped

    def run(self, graph: str, feeds: dict[str, torch.Tensor], outputs: list[str]) -> list[torch.Tensor]:
        arrays = {k: np.ascontiguousarray(v.numpy()) for k, v in feeds.items()}
        return [torch.from_numpy(o) for o in self.sessions[graph].run(outputs, arrays)]

    def close(self) -> None:
        self.sessions.clear()


def load(path: Path, config: dict, options: LoadOptions) -> Loaded:
    """An export dir of torch-exported prefill / decode graphs (a TensorRT dir's ONNX graphs too)."""
    tokenizer = export_tokenizer(path, config)
    export = config["export"]
    tensorrt = export.get("format") == "tensorrt"
    graphs = export_graph_paths(path, export, nested="onnx" if tensorrt else None)
    dims = export_dims(path, export)
    dtype = PRECISION_DTYPE.get(export.get("precision", "fp32"), torch.float32)
    runner = OrtRunner(graphs, options.threads, TENSORRT_SEMANTICS if tensorrt else None)
    backend = GraphBackend(runner, **dims, n_slots=options.max_batch, max_len=options.max_len, dtype=dtype,
                           name="onnxruntime", verifies=True)
    return Loaded(backend, tokenizer, {"precision": export.get("precision")})
