"""The runtime that serves an engine, in the words a refusal or a startup line uses: prunus's native kernels (and
their path), ONNX Runtime, the torch backend, TensorRT; never the name of a runtime that is not the one serving."""

from __future__ import annotations

WORDS = {"native": "prunus's native kernels", "ort_genai": "ONNX Runtime (genai graph)",
         "ort_graphs": "ONNX Runtime (prefill / decode graphs)", "torch": "the torch backend",
         "torch_tp": "the torch backend with tensor parallelism", "tensorrt": "TensorRT",
         "torch_module": "the torch backend (generic module)", "ort_module": "ONNX Runtime (generic module)"}


def runtime_words(info: dict) -> str:
    """What serves the engine whose info is ``info``: "prunus's native kernels (avx2)", "ONNX Runtime", ..."""
    runtime = info.get("runtime") or info.get("backend") or "this runtime"
    words = WORDS.get(runtime, str(runtime))
    if runtime == "native" and info.get("native_isa"):
        words += f" ({info['native_isa']})"
    return words
