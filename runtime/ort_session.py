"""ONNX Runtime sessions as prunus opens them: thread counts, spinning, lean arenas, and variants of a graph.

Every graph ONNX Runtime loads is checked before its session is handed out: its float initializers finite, its
quantization scales finite (and positive where divided by), one line naming the first damaged one
(:mod:`prunus.artifacts.onnx_initializers`). ONNX Runtime reads it first, so a file that is no graph, or external data
outside its dir, is ONNX Runtime's own refusal, as before."""

from __future__ import annotations

from pathlib import Path


def ort_session(path: str | Path | bytes, threads: int | None = None, spinning: bool = True,
                config: dict | None = None, lean: bool = False, name: str | None = None):
    """``path``: a graph file, or a serialized graph's bytes. ``spinning=False`` lets the session's idle
    threads sleep at once: for processes holding many sessions that run in turn, whose spinning threads
    would otherwise take each other's cores.
    ``config``: extra session config entries (key -> value strings). ``lean``: no CPU memory arena and no
    memory pattern, so each pass allocates and frees its own buffers (the prompt twin's dequantized weights:
    SmolLM2 int8 with its twin grew the process by 1,462 MB with both and 603 MB without, passes as fast).
    The graph's initializers are checked once ONNX Runtime has read it
    (:func:`~prunus.artifacts.onnx_initializers.check_initializers`; ``name``: how an error names the graph)."""
    import onnxruntime as ort

    from prunus.artifacts.onnx_initializers import check_initializers

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    for key, value in (config or {}).items():
        opts.add_session_config_entry(key, value)
    if lean:
        opts.enable_cpu_mem_arena = False
        opts.enable_mem_pattern = False
    opts.log_severity_level = 3
    session = ort.InferenceSession(path if isinstance(path, bytes) else str(path), opts,
                                   providers=["CPUExecutionProvider"])
    check_initializers(path, name)
    return session


def variant_session(source, variant, tag: str, threads: int | None = None, spinning: bool = True,
                    config: dict | None = None, lean: bool = False):
    """An ONNX Runtime session of ``variant``, a changed copy of the graph at ``source`` (a path or bytes), loaded
    from a file that is removed after: beside the graph's data file when its initializers are external, else in
    a temporary dir. (A session made from bytes keeps them for its lifetime: the int8 SmolLM2 graph's 254 MB.)"""
    import tempfile

    import onnx

    external = not isinstance(source, bytes) and any(t.data_location == onnx.TensorProto.EXTERNAL
                                                     for t in variant.graph.initializer)
    with tempfile.TemporaryDirectory(prefix="prunus-") as tmp:
        target = Path(source).with_name(f".{Path(source).stem}.{tag}.onnx") if external else Path(tmp) / f"{tag}.onnx"
        onnx.save_model(variant, str(target))
        try:
            label = f"{source if not isinstance(source, bytes) else 'the ONNX graph'} ({tag} variant)"
            return ort_session(target, threads, spinning, config, lean, label)  # errors name the graph it copies
        finally:
            target.unlink()
