"""The TensorRT backend: an export dir's ``prefill.plan`` / ``decode.plan`` engines (TensorRT 10 API).

Each engine is deserialized once with its execution context; a pass sets every
input's shape, points every input and output at a torch CUDA tensor
(``set_tensor_address``), and runs ``execute_async_v3`` on a torch CUDA stream. The
KV cache and continuous batching are the graph backend's, the same as ONNX Runtime's.
Needs the ``tensorrt`` package and a CUDA GPU; without them, one clear error.
"""

from __future__ import annotations

from pathlib import Path

import torch

from prunus.models import PrunusError

from prunus.export.tensorrt_build import check_tensorrt as export_check_tensorrt

from .backend_graph import GraphBackend
from .backend_onnxruntime import export_graph_paths


def check_tensorrt():
    """The ``tensorrt`` module, or a PrunusError naming what is missing."""
    return export_check_tensorrt("the tensorrt backend",
                                 "serve an ONNX export with --backend onnxruntime on this machine")


class TrtRunner:
    def __init__(self, plans: dict[str, Path], device: str = "cuda"):
        trt = check_tensorrt()
        self.trt = trt
        self.device = torch.device(device if device.startswith("cuda") else "cuda")
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engines, self.contexts = {}, {}
        for kind, path in plans.items():
            engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
            if engine is None:
                raise PrunusError(f"{path}: TensorRT cannot deserialize this engine (built by another TensorRT "
                                  "version or for another GPU?); rebuild it with prunus export --format tensorrt")
            self.engines[kind] = engine
            self.contexts[kind] = engine.create_execution_context()
        self.stream = torch.cuda.Stream(device=self.device)
        self.dtypes = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
                       trt.DataType.INT64: torch.int64, trt.DataType.INT32: torch.int32,
                       trt.DataType.BF16: torch.bfloat16}

    def run(self, graph: str, feeds: dict[str, torch.Tensor], outputs: list[str]) -> list[torch.Tensor]:
        engine, ctx = self.engines[graph], self.contexts[graph]
        keep = []
        for name, t in feeds.items():
            t = t.to(self.device, self.dtypes[engine.get_tensor_dtype(name)]).contiguous()
            keep.append(t)
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        outs = []
        for name in outputs:
            o = torch.empty(tuple(ctx.get_tensor_shape(name)), dtype=self.dtypes[engine.get_tensor_dtype(name)],
                            device=self.device)
            ctx.set_tensor_address(name, o.data_ptr())
            outs.append(o)
        with torch.cuda.stream(self.stream):
            if not ctx.execute_async_v3(self.stream.cuda_stream):
                raise PrunusError(f"TensorRT: the {graph} engine failed to run (shapes outside its profile?)")
        self.stream.synchronize()
        return outs

    def close(self) -> None:
        self.contexts.clear()
        self.engines.clear()


def load_tensorrt_backend(path: Path, config: dict, n_slots: int, max_len: int, device: str = "cuda") -> GraphBackend:
    check_tensorrt()
    export = config["export"]
    plans = export_graph_paths(path, export)
    dims = {k: int(export[k]) for k in ("n_layers", "n_kv_heads", "head_dim", "vocab_size")}
    dtype = torch.float16 if export.get("precision") == "fp16" else torch.float32
    dev = device if device.startswith("cuda") else "cuda"
    return GraphBackend(TrtRunner(plans, dev), **dims, n_slots=n_slots, max_len=max_len, dtype=dtype, device=dev,
                        name="tensorrt")
