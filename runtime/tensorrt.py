"""The TensorRT backend: an export dir's ``prefill.plan`` / ``decode.plan`` engines (TensorRT 10 API).

Each engine is deserialized once with its execution context; a pass sets every
input's shape, points every input and output at a torch CUDA tensor
(``set_tensor_address``), and runs ``execute_async_v3`` on a CUDA stream of its own
that first waits for torch's current stream (where the feeds were made). The
KV cache and continuous batching are the graph backend's, the same as ONNX Runtime's.
Needs the ``tensorrt`` package and a CUDA GPU; without them, one clear error.
"""

from __future__ import annotations

from pathlib import Path

import torch

from prunus.artifacts.errors import PrunusError

from .artifact import export_dims, export_graph_paths, export_tokenizer
from .graph_backend import GraphBackend
from .load_options import LoadOptions
from .registry import Loaded


def require_tensorrt(what: str, instead: str):
    """The ``tensorrt`` module, or a PrunusError naming what is missing (``what`` needs it; do ``instead``)."""
    try:
        import tensorrt as trt
    except ImportError:
        raise PrunusError(f"{what} needs the tensorrt package (pip install tensorrt, from NVIDIA's index) "
                          f"and a CUDA GPU; {instead}") from None
    if not torch.cuda.is_available():
        raise PrunusError(f"{what} needs a CUDA GPU and none is visible; {instead}")
    return trt


def check_tensorrt():
    """The ``tensorrt`` module, or a PrunusError naming what is missing."""
    return require_tensorrt("the tensorrt backend", "serve an ONNX export with --backend onnxruntime on this machine")


def trt_dtypes(trt) -> dict:
    """TensorRT's tensor data types -> torch dtypes, for the ones our engines take and return."""
    return {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16, trt.DataType.INT64: torch.int64,
            trt.DataType.INT32: torch.int32, trt.DataType.BF16: torch.bfloat16}


class TrtRunner:
    """The graph runner (``run(graph, feeds, outputs)``, see :mod:`prunus.runtime.graph_backend`) over TensorRT.

    Its boundary is given, not imported, so its own logic runs under test with stand-ins: ``runtime``
    (``deserialize_cuda_engine``; kept, as TensorRT wants it to outlive its engines), the engines it
    returns (``get_tensor_dtype``, ``create_execution_context``), their contexts (``set_input_shape``,
    ``set_tensor_address``, ``get_tensor_shape``, ``execute_async_v3``), ``dtypes`` (:func:`trt_dtypes`)
    and ``stream`` (a ``torch.cuda.Stream``: ``wait_stream``, ``cuda_stream``, ``synchronize``).
    :meth:`load` builds the real ones."""

    def __init__(self, runtime, plans: dict[str, Path], dtypes: dict, device: torch.device, stream):
        self.runtime, self.dtypes, self.device, self.stream = runtime, dtypes, torch.device(device), stream
        self.engines, self.contexts = {}, {}
        for kind, path in plans.items():
            engine = runtime.deserialize_cuda_engine(Path(path).read_bytes())
            if engine is None:
                raise PrunusError(f"{path}: TensorRT cannot deserialize this engine (built by another TensorRT "
                                  "version or for another GPU?); rebuild it with prunus export --format tensorrt")
            self.engines[kind] = engine
            self.contexts[kind] = engine.create_execution_context()

    @classmethod
    def load(cls, plans: dict[str, Path], device: str = "cuda") -> "TrtRunner":
        trt = check_tensorrt()
        dev = torch.device(device if device.startswith("cuda") else "cuda")
        return cls(trt.Runtime(trt.Logger(trt.Logger.WARNING)), plans, trt_dtypes(trt), dev,
                   torch.cuda.Stream(device=dev))

    def run(self, graph: str, feeds: dict[str, torch.Tensor], outputs: list[str]) -> list[torch.Tensor]:
        engine, ctx = self.engines[graph], self.contexts[graph]
        keep = []  # the inputs live until the engine has run
        for name, t in feeds.items():
            t = t.to(self.device, self.dtypes[engine.get_tensor_dtype(name)]).contiguous()
            keep.append(t)
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        outs = []
        for name in outputs:  # shapes known once every input's shape is set
            o = torch.empty(tuple(ctx.get_tensor_shape(name)), dtype=self.dtypes[engine.get_tensor_dtype(name)],
                            device=self.device)
            ctx.set_tensor_address(name, o.data_ptr())
            outs.append(o)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the feeds' copies and gathers first
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise PrunusError(f"TensorRT: the {graph} engine failed to run (shapes outside its profile?)")
        self.stream.synchronize()
        return outs

    def close(self) -> None:
        self.contexts.clear()
        self.engines.clear()


def load(path: Path, config: dict, options: LoadOptions) -> Loaded:
    """A TensorRT export dir's ``prefill.plan`` / ``decode.plan`` on a CUDA GPU."""
    tokenizer = export_tokenizer(path, config)
    check_tensorrt()
    export = config["export"]
    plans = export_graph_paths(path, export)
    dtype = torch.float16 if export.get("precision") == "fp16" else torch.float32
    dev = options.device if options.device.startswith("cuda") else "cuda"
    backend = GraphBackend(TrtRunner.load(plans, dev), **export_dims(path, export), n_slots=options.max_batch,
                           max_len=options.max_len, dtype=dtype, device=dev, name="tensorrt")
    return Loaded(backend, tokenizer, {"precision": export.get("precision")})
