"""TensorRT engines from the exported ONNX graphs (TensorRT 10 Python API).

Explicit batch (the TensorRT 10 default: ``create_network(0)``), one optimization
profile covering the dynamic axes (batch, seq / new, past), precision by builder flag
(FP16; INT8 and FP8 take the scales from the graph's Q/DQ nodes), and a timing cache
that is loaded when present and saved after the build, so rebuilding is fast.
Needs the ``tensorrt`` package and a CUDA GPU; :func:`check_tensorrt` says which is missing.
"""

from __future__ import annotations

from pathlib import Path

from prunus.artifacts.errors import PrunusError
from prunus.runtime.tensorrt import require_tensorrt

WORKSPACE_BYTES = 4 << 30


def check_tensorrt(what: str = "--format tensorrt", instead: str = "use --format onnx on this machine"):
    """The ``tensorrt`` module, or a PrunusError naming what is missing (``what`` needs it; do ``instead``)."""
    return require_tensorrt(what, instead)


def profile_shapes(graph: str, n_layers: int, n_kv_heads: int, head_dim: int, max_seq_len: int,
                   max_batch: int = 8, opt_batch: int = 1) -> dict[str, tuple[tuple, tuple, tuple]]:
    """name -> (min, opt, max) shapes for every dynamic input of ``graph`` ("prefill" or "decode")."""
    s_max, s_opt = max_seq_len, min(128, max_seq_len)
    if graph == "prefill":
        tok = ((1, 1), (opt_batch, s_opt), (max_batch, s_max))
        return {n: tok for n in ("input_ids", "position_ids", "attention_mask")}
    past = ((1, n_kv_heads, 1, head_dim), (opt_batch, n_kv_heads, s_opt, head_dim),
            (max_batch, n_kv_heads, s_max - 1, head_dim))
    shapes = {"input_ids": ((1, 1), (opt_batch, 1), (max_batch, 1)),
              "position_ids": ((1, 1), (opt_batch, 1), (max_batch, 1)),
              "attention_mask": ((1, 2), (opt_batch, s_opt + 1), (max_batch, s_max))}
    for i in range(n_layers):
        shapes[f"past.{i}.key"] = shapes[f"past.{i}.value"] = past
    return shapes


def build_engine(onnx_path: Path, plan_path: Path, precision: str, shapes: dict, timing_cache: Path) -> dict:
    """Parse ``onnx_path``, build with ``shapes`` as the profile, write the serialized engine; its build config."""
    trt = check_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise PrunusError(f"{onnx_path}: TensorRT cannot parse the graph ({errors})")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    # int4: the INT4 weights of blocked DequantizeLinear (INT8 for the int8 blocks of a mixed recipe); a flag
    # this TensorRT version lacks is left out
    flags = {"fp16": ["FP16"], "int8": ["INT8", "FP16"], "fp8": ["FP8", "FP16"],
             "int4": ["INT4", "INT8", "FP16"]}.get(precision, [])
    flags = [f for f in flags if hasattr(trt.BuilderFlag, f)]
    for flag in flags:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise PrunusError(f"{onnx_path}: TensorRT could not build an engine at {precision}; see the log above")
    plan_path.write_bytes(bytes(engine))
    timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    return {"onnx": onnx_path.name, "precision": precision, "flags": flags, "workspace_bytes": WORKSPACE_BYTES,
            "profile": {n: [list(s) for s in v] for n, v in shapes.items()}, "tensorrt": trt.__version__}
