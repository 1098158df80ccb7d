"""Parity of what is served: a genai export checked in every runtime that may serve it.

A genai export is served by prunus's native kernels where they run (``native="auto"``) and by ONNX Runtime
elsewhere, so its parity check scores both against the same PyTorch reference (made once), with the same limits
(:data:`prunus.export.parity.TOLERANCES`): ONNX Runtime over the written graph, and the native kernels over the
written ``native_weights.safetensors`` on this CPU's kernel path, through the native backend that serves
(:mod:`prunus.export.backend_parity`). ``parity.json`` keeps ONNX Runtime's report at its
top level (the graph's own check: a graph that fails it is not written) and each runtime's figures under
``runtimes``; kernels that fail their limits are recorded as failed, and ``native="auto"`` then serves the export in
ONNX Runtime (:func:`prunus.runtime.native_parity.recorded_native_off`). Where the kernels cannot run here the record
says why, and they are checked nowhere else.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from prunus.artifacts.errors import PrunusError
from prunus.runtime.native_parity import INT_ACTIVATIONS, chosen_isa, native_check_off

from .backend_parity import native_graphs
from .parity import compare

# the figures each runtime's record repeats from its report
RUNTIME_KEYS = ("max_abs_logits", "top1_agreement", "bpb_onnx", "bpb_increase", "greedy_agreement",
                "decode_agreement", "greedy_identical_rows", "greedy_tokens", "tolerances", "failed", "passed")


def _finite(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


def runtime_record(report: dict, **extra) -> dict:
    """A runtime's entry of ``runtimes``: its figures (non-finite ones as null) and ``extra``."""
    record = {k: _finite(report[k]) for k in RUNTIME_KEYS if k in report}
    record["bpb"] = record.pop("bpb_onnx", None)
    return {"checked": True, **record, **extra}


def ort_record(report: dict, precision: str) -> dict:
    """ONNX Runtime's entry: its figures, and how its MatMulNBits kernels (accuracy level 4) see activations."""
    activations = "float32" if precision in ("fp32", "fp16") else "int8 per block (MatMulNBits accuracy level 4)"
    return runtime_record(report, activations=activations)


def native_parity(model, graph: Path, dims: dict, ref: dict, val, token_bytes, precision: str) -> dict:
    """The native kernels' record: ``ref`` (:func:`prunus.export.parity.torch_reference`) against the kernels on this
    CPU's path, or why they could not be checked here."""
    why = native_check_off(Path(graph).parent)
    if why is not None:
        return {"checked": False, "why": why}
    from prunus.runtime.native_decoder import pack_export

    try:
        graphs = native_graphs(pack_export(graph, dims), threads=os.cpu_count())
    except PrunusError as e:  # weights the kernels do not take: they never serve this export
        return {"checked": False, "why": str(e).split(": ", 1)[-1]}
    report = compare(ref, graphs, val, token_bytes, precision)
    activations = "float32" if precision in ("fp32", "fp16") else INT_ACTIVATIONS
    return runtime_record(report, isa=chosen_isa(), activations=activations)
