"""Whether a model is decoded by prunus's native kernels: ``native="auto"`` (the default) settled at load.

The native runtime (:mod:`prunus.runtime.native_backend`: every pass in prunus's own CPU kernels, no ONNX Runtime
session in memory) loads a genai export, and a transformer model dir directly (its stored float / int8 / int4
weights packed at load), wherever the kernels run: an x86-64 CPU with AVX2, FMA and F16C, a C compiler to build them
once, and weights the kernels mirror. A genai export also needs the ``native_weights.safetensors`` it wrote, a parity
check that did not fail on them, and no option that needs ONNX Runtime (``prompt_graph``: the prompt twin is an ONNX
Runtime graph); elsewhere it loads on ONNX Runtime (:mod:`prunus.runtime.ort_genai`). A model dir needs what the torch
backend alone serves to be off (another device, tensor parallelism, a device map, a dtype, ``compile=True``, an
explicit ``backend="torch"``) and the kernels' kept parity check of the dir passed (``prunus serve`` runs it once);
elsewhere it loads on torch. Either way the info's ``native`` says why, in one line.
``native=False`` (``--no-native``) keeps ONNX Runtime / torch; ``native=True`` (``--native``) asks for the kernels and
is refused in one line where they cannot run. The ``kv_dtype="f16"`` cache exists only in the native kernels: it
cannot fall back.

Why the kernels by default: faster decode than ONNX Runtime over the same weights, peak memory no higher
(docs/defaults.md, docs/results.md).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.native_layout import NATIVE_WEIGHTS

from .load_options import NATIVE_AUTO, LoadOptions
from .native_parity import dir_parity_line, native_parity_line, recorded_dir_native_off, recorded_native_off


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


def is_model_dir(config: dict) -> bool:
    """A transformer model dir (not an export, not a generic module's dir)."""
    return "export" not in config and config.get("kind") is None


NATIVE_SCHEMES = ("int8-weight-only", "int4-weight-only")  # the stored schemes the kernels take


def stored_off(config: dict) -> str | None:
    """Why a model dir's architecture or stored weights are not the native kernels' (what they do not mirror, a
    scheme that quantizes activations), or None."""
    from prunus.models.compression_state import CompressionState
    from prunus.models.config import ModelConfig

    from .native_tensors import unmirrored

    try:
        missing = unmirrored(ModelConfig.from_dict(config.get("model") or {}, source="config.json"))
        modules = CompressionState.from_json(config.get("compression")).quantized_modules
    except (PrunusError, TypeError, ValueError):
        return None  # the load names what is wrong
    if missing:
        return f"the native kernels do not mirror its {', '.join(missing)}"
    schemes = sorted({str(m.get("scheme")) for m in modules.values()} - set(NATIVE_SCHEMES))
    return f"its {schemes[0]} weights are not the native kernels' (int8 / int4 weight-only)" if schemes else None


def model_dir_off(path: Path, config: dict, options: LoadOptions, asked_backend: str | None = None,
                  parity: bool = True) -> str | None:
    """Why a transformer model dir is not decoded natively (None: it is tried natively): an option only the torch
    backend serves, weights the kernels do not take, a CPU they do not run on, or their kept parity check of the dir
    failed or is not there yet (:func:`prunus.runtime.native_parity.recorded_dir_native_off`; ``parity=False``: not
    asked, as where the kernels were asked for by name, or where ``prunus serve`` checks the dir next)."""
    from prunus.native.build import cpu_supported

    reasons = ((asked_backend is not None, f"--backend {asked_backend} was asked for"),
               (options.device != "cpu", f"it runs on {options.device}"),
               (options.tp > 1, f"tp={options.tp} runs on the torch backend's workers"),
               (options.device_map is not None, "a device map places it for the torch backend"),
               (options.dtype is not None, f"dtype={options.dtype} is the torch backend's"),
               (options.compile is True, "compile=True is the torch backend's"))
    why = next((why for hit, why in reasons if hit), None) or stored_off(config)
    if why is None and (cpu := cpu_supported()) is not None:
        why = f"the native kernels need {cpu}"
    return why or (recorded_dir_native_off(path) if parity else None)


def resolve_native(path: Path, backend: str, config: dict, options: LoadOptions,
                   asked_backend: str | None = None) -> tuple[LoadOptions, str | None]:
    """``options`` with native settled to True or False, and the reason it is off where "auto" turned it off
    (``asked_backend``: the backend the caller named, None where the artifact chose it)."""
    model_dir = backend == "torch" and is_model_dir(config)
    if options.native is True and model_dir and (why := model_dir_off(path, config, options, asked_backend, parity=False)) is not None:
        raise PrunusError(f"{path}: native=True decodes in prunus's kernels, and {why}; drop --native")
    if options.native != NATIVE_AUTO:
        return options, None
    if model_dir:
        why = model_dir_off(path, config, options, asked_backend)
    elif backend == "onnxruntime" and is_genai(config):
        why = native_off(path, options)
    else:
        return replace(options, native=False), None
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
    if is_genai(config) or is_model_dir(config):
        note = "on" if chosen.native is True else f"off: {why}" if why else "off: native=False (--no-native)"
    if is_genai(config):
        loaded.info["native_parity"] = native_parity_line(path)
    elif runtime.name == "native":
        loaded.info["native_parity"] = dir_parity_line(path)
    return runtime, loaded, note
