"""The runtimes: one row each, naming the ``--backend`` it serves under, what artifact it recognises, and the
module whose ``load(path, config, options)`` builds its :class:`~prunus.runtime.backend.Backend`.

Torch-free at import: the CLI reads :data:`BACKENDS` without importing torch; a runtime's module is imported
when it loads. ``Engine.load`` (:mod:`prunus.serve.engine`) is :func:`load_runtime`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .backend_names import BACKENDS  # noqa: F401 (the CLI reads it here)
from .load_options import LoadOptions

# What a row may declare it accepts beyond plain decoding: (the load setting, in words, the flag that asks for it)
FEATURES = {"prefix_cache": ("prefix caching", "--prefix-cache-mb"),
            "draft": ("speculative decoding", "--speculative"),
            "device_map": ("a device map", "--device-map"),
            "prompt_graph": ("the prompt graph", "--prompt-graph"),
            "kv_f16": ("a float16 KV cache", "--kv-dtype f16")}


@dataclass
class Loaded:
    """What a runtime's ``load`` returns: the backend, the tokenizer, and facts for the engine's info."""

    backend: object
    tokenizer: object
    info: dict = field(default_factory=dict)


def _export(config: dict) -> dict:
    export = config.get("export")
    return export if isinstance(export, dict) else {}


def _module(config: dict) -> bool:
    return config.get("kind") == "module"


def _genai(config: dict) -> bool:
    return _export(config).get("format") == "onnx" and _export(config).get("graph") == "genai"


@dataclass(frozen=True)
class Runtime:
    name: str
    backend: str  # the --backend it serves under
    module: str  # prunus.runtime.<module>, whose load(path, config, options) -> Loaded
    loads: str  # what it recognises, in words
    recognises: Callable[[dict, LoadOptions], bool]
    accepts: frozenset = frozenset()  # the FEATURES it serves; asked of a row that lacks one, the load is refused
    also: tuple = ()  # other backends it serves under (the native kernels: a model dir's "torch" as well)

    def serves(self, backend: str) -> bool:
        return backend == self.backend or backend in self.also

    def load(self, path: Path, config: dict, options: LoadOptions) -> Loaded:
        return importlib.import_module(f"prunus.runtime.{self.module}").load(path, config, options)


# First match wins: a row narrower than the next comes first.
RUNTIMES = (
    Runtime("torch_module", "torch", "torch_module", "a generic model dir (any nn.Module): predict, dynamic batching",
            lambda c, o: _module(c) and "export" not in c),
    Runtime("ort_module", "onnxruntime", "ort_module", "a generic module's ONNX export dir: predict, dynamic batching",
            lambda c, o: _module(c) and _export(c).get("graph") == "module"),
    Runtime("torch_tp", "torch", "torch_tp", "a model dir with tp > 1 (one worker process per shard)",
            lambda c, o: "export" not in c and o.tp > 1),
    Runtime("native", "onnxruntime", "native_backend",
            "a model dir or an ONNX genai export dir, native=True (every pass in prunus's kernels)",
            lambda c, o: o.native is True and (_genai(c) or "export" not in c and o.tp == 1),
            frozenset({"prefix_cache", "draft", "kv_f16"}), also=("torch",)),
    Runtime("torch", "torch", "torch", "a model dir, plain or compressed (with device_map: placed across devices)",
            lambda c, o: "export" not in c, frozenset({"prefix_cache", "draft", "device_map"})),
    Runtime("ort_genai", "onnxruntime", "ort_genai", "an ONNX export dir whose export.graph is 'genai'",
            lambda c, o: _genai(c), frozenset({"prefix_cache", "prompt_graph"})),
    Runtime("ort_graphs", "onnxruntime", "ort_graphs", "an ONNX export dir of prefill / decode graphs",
            lambda c, o: _export(c).get("format") in ("onnx", "tensorrt")),
    Runtime("tensorrt", "tensorrt", "tensorrt", "a TensorRT export dir (prefill.plan / decode.plan)",
            lambda c, o: _export(c).get("format") == "tensorrt"),
)


def find_runtime(backend: str, config: dict, options: LoadOptions) -> Runtime:
    """The first row serving under ``backend`` that recognises the artifact's config.json."""
    return next(r for r in RUNTIMES if r.serves(backend) and r.recognises(config, options))


def asked(options: LoadOptions) -> set[str]:
    """The FEATURES ``options`` ask of a runtime."""
    wanted = {"prefix_cache": bool(options.features.prefix_cache_mb), "draft": options.features.draft is not None,
              "device_map": options.device_map is not None, "prompt_graph": bool(options.prompt_graph),
              "kv_f16": options.kv_dtype == "f16"}
    return {name for name, on in wanted.items() if on}


def check_accepted(path: Path, runtime: Runtime, wanted: set[str]) -> None:
    """One line naming the first feature asked of ``runtime`` that its row does not declare, where it is served
    instead and the flag to drop (never ignored)."""
    for name in sorted(wanted - runtime.accepts):
        from prunus.artifacts.errors import PrunusError

        words, flag = FEATURES[name]
        where = "; ".join(r.loads for r in RUNTIMES if name in r.accepts)
        raise PrunusError(f"{path}: {words} is not served for {runtime.loads}, only for: {where}; drop {flag}")


def load_runtime(path: str | Path, backend: str | None, options: LoadOptions) -> Loaded:
    """The artifact at ``path`` (a model dir or an export dir) loaded by its runtime, every option checked first;
    ``backend=None`` picks the one the artifact needs. ``info`` holds what was loaded and how."""
    from dataclasses import replace

    from .artifact import resolve_backend

    path = Path(path)
    asked_backend = backend
    backend, config = resolve_backend(path, backend)
    options.check(backend)
    options = replace(options, max_len=options.max_len_for(config))
    options.check_placement(backend)
    from .native_choice import load_chosen, resolve_native

    chosen = resolve_native(path, backend, config, options, asked_backend)  # native="auto" settled, with why it is off
    runtime = find_runtime(backend, config, chosen[0])
    features = options.features
    check_accepted(path, runtime, asked(options))
    if features.draft is not None:
        from .eagle_drafter import AUTO, check_draft, find_draft

        if str(features.draft) == AUTO:  # an EAGLE draft beside the target, else prompt lookup
            features = replace(features, draft=find_draft(path))
            options = replace(options, features=features)
        check_draft(path, config, features.draft)  # a draft that does not fit: one line, before the target loads
    runtime, loaded, native = load_chosen(path, config, options, chosen, lambda o: find_runtime(backend, config, o))
    if native is not None:
        loaded.info["native"] = native
    if features.draft is not None:
        loaded.info["draft"] = str(features.draft)
    loaded.info = {"path": str(path), "backend": backend, "runtime": runtime.name, "tp": options.tp,
                   "device": options.device, "max_batch": options.max_batch, "max_len": options.max_len,
                   "compile": options.compile is True, **loaded.info}
    return loaded
