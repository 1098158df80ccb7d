"""Whether a genai export is decoded by prunus's native kernels: ``native="auto"`` (the default) settled at load.

A genai export loads on the native runtime (:mod:`prunus.runtime.native`: every pass in prunus's own CPU kernels, no
ONNX Runtime session in memory) wherever the kernels run: an x86-64 CPU with AVX2, FMA and F16C, a C compiler to
build them once, an export that wrote ``native_weights.safetensors`` for a graph the kernels mirror, and no option
that needs ONNX Runtime (``prompt_graph``: the prompt twin is an ONNX Runtime graph). Elsewhere it loads on ONNX
Runtime (:mod:`prunus.runtime.ort_genai`), and the info's ``native`` says why, in one line. ``native=False``
(``--no-native``) keeps ONNX Runtime; ``native=True`` (``--native``) asks for the kernels and is refused in one line
where they cannot run. The ``kv_dtype="f16"`` cache exists only in the native kernels: it cannot fall back.

Why the kernels by default (SmolLM2-135M, docs/results.md, native decoder): decode tokens/s at batch 1 over the
genai graph in ONNX Runtime 1.0-1.4x, peak memory no higher (``benchmarks/native_memory.py``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.native_layout import NATIVE_WEIGHTS

from .load_options import NATIVE_AUTO, LoadOptions
from .native_parity import native_parity_line, recorded_native_off


def is_genai(config: dict) -> bool:
    export = config.get("export") or {}
    return export.get("format") == "onnx" and export.get("graph") == "genai"


def cpu_problem() -> str | None:
    """Why this CPU cannot run the native kernels at all (None: it can), for a stage that may not import them."""
    from prunus.native.build import cpu_supported

    return cpu_supported()


def native_off(path: Path, options: LoadOptions) -> str | None:
    """Why a genai export at ``path`` is not decoded natively under native="auto" (None: it is tried natively).
    The checks that cost nothing come first; a build or a weights file that fails later falls back too
    (:func:`load_chosen`)."""
    from prunus.native.build import cpu_supported

    if options.device != "cpu":
        return f"it runs on {options.device}"
    if options.prompt_graph:
        return "--prompt-graph runs long prompts in ONNX Runtime"
    cpu = cpu_supported()
    if cpu is not None:
        return f"the native kernels need {cpu}"
    if not (path / NATIVE_WEIGHTS).is_file():
        return f"the export has no {NATIVE_WEIGHTS} (an export of an older prunus; re-export to decode natively)"
    return recorded_native_off(path)  # kernels whose parity check failed are not what serves


def resolve_native(path: Path, backend: str, config: dict, options: LoadOptions) -> tuple[LoadOptions, str | None]:
    """``options`` with native settled to True or False, and the reason it is off where "auto" turned it off."""
    if options.native != NATIVE_AUTO:
        return options, None
    if backend != "onnxruntime" or not is_genai(config):
        return replace(options, native=False), None
    why = native_off(path, options)
    if why is None:
        return replace(options, native=True), None
    if options.kv_dtype == "f16":
        raise PrunusError(f"{path}: kv_dtype='f16' is the native decoder's KV cache, and {why}; drop --kv-dtype f16")
    return replace(options, native=False), why


def load_chosen(path: Path, config: dict, options: LoadOptions, resolved: tuple[LoadOptions, str | None], find):
    """(the runtime row, the Loaded, the info's ``native`` entry) for ``path`` under ``options``, ``resolved`` being
    :func:`resolve_native`'s answer for them; ``find(options)`` gives the registry's row. Under native="auto" a
    native load refused in one line (no compiler, weights the kernels do not take) loads on ONNX Runtime instead,
    the reason kept; an explicit native=True never falls back."""
    auto = options.native == NATIVE_AUTO
    chosen, why = resolved
    runtime = find(chosen)
    try:
        loaded = runtime.load(path, config, chosen)
    except PrunusError as e:
        if not (auto and chosen.native is True and options.kv_dtype != "f16"):
            raise
        chosen, why = replace(chosen, native=False), str(e)
        runtime = find(chosen)
        loaded = runtime.load(path, config, chosen)
    note = None
    if is_genai(config) and runtime.backend == "onnxruntime":
        note = "on" if chosen.native is True else f"off: {why}" if why else "off: native=False (--no-native)"
        loaded.info["native_parity"] = native_parity_line(path)
    return runtime, loaded, note
