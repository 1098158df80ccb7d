"""The runtime that serves an engine, in the words a refusal or a startup line uses: prunus's native kernels (and
their path), ONNX Runtime, the torch backend, TensorRT (each row's ``words`` in the runtime table); never the name
of a runtime that is not the one serving."""

from __future__ import annotations

def runtime_words(info: dict) -> str:
    """What serves the engine whose info is ``info``: "prunus's native kernels (avx2)", "ONNX Runtime", ..."""
    from prunus.runtime.registry import RUNTIMES

    runtime = info.get("runtime") or info.get("backend") or "this runtime"
    words = next((r.words for r in RUNTIMES if r.name == runtime), str(runtime))
    if runtime == "native" and info.get("native_isa"):
        words += f" ({info['native_isa']})"
    return words
