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
FEATURES = {"tp": ("tensor parallelism", "--tp"),
            "compile": ("a compiled decode step", "--compile"),
            "native": ("decoding in the native kernels", "--native"),
            "prefix_cache": ("prefix caching", "--prefix-cache-mb"),
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
    words: str  # what serves, in the words a refusal or a startup line uses
    accepts: frozenset = frozenset()  # the FEATURES it serves; asked of a row that lacks one, the load is refused
    also: tuple = ()  # other backends it serves under (the native kernels: a model dir's "torch" as well)

    def serves(self, backend: str) -> bool:
        return backend == self.backend or backend in self.also

    def load(self, path: Path, config: dict, options: LoadOptions) -> Loaded:
        return importlib.import_module(f"prunus.runtime.{self.module}").load(path, config, options)


# First match wins: a row narrower than the next comes first.
RUNTIMES = (
    Runtime("torch_module", "torch", "torch_module", "a generic model dir (any nn.Module): predict, dynamic batching",
            lambda c, o: _module(c) and "export" not in c, "the torch backend (generic module)"),
    Runtime("ort_module", "onnxruntime", "ort_module", "a generic module's ONNX export dir: predict, dynamic batching",
            lambda c, o: _module(c) and _export(c).get("graph") == "module", "ONNX Runtime (generic module)"),
    Runtime("torch_tp", "torch", "torch_tp", "a model dir with tp > 1 (one worker process per shard)",
            lambda c, o: "export" not in c and o.tp > 1, "the torch backend with tensor parallelism",
            frozenset({"tp"})),
    Runtime("native", "onnxruntime", "native_backend",
            "a model dir or an ONNX genai export dir, native=True (every pass in prunus's kernels)",
            lambda c, o: o.native is True and (_genai(c) or "export" not in c and o.tp == 1), "prunus's native kernels",
            frozenset({"native", "prefix_cache", "draft", "kv_f16"}), also=("torch",)),
    Runtime("torch_placed", "torch", "torch", "a model dir with a device map (its modules placed across devices)",
            lambda c, o: "export" not in c and o.device_map is not None, "the torch backend (device map)",
            frozenset({"device_map"})),
    Runtime("torch", "torch", "torch", "a model dir, plain or compressed",
            lambda c, o: "export" not in c, "the torch backend", frozenset({"compile", "prefix_cache", "draft"})),
    Runtime("ort_genai", "onnxruntime", "ort_genai", "an ONNX export dir whose export.graph is 'genai'",
            lambda c, o: _genai(c), "ONNX Runtime (genai graph)", frozenset({"prefix_cache", "prompt_graph"})),
    Runtime("ort_graphs", "onnxruntime", "ort_graphs", "an ONNX export dir of prefill / decode graphs",
            lambda c, o: _export(c).get("format") in ("onnx", "tensorrt"),
            "ONNX Runtime (prefill / decode graphs)"),
    Runtime("tensorrt", "tensorrt", "tensorrt", "a TensorRT export dir (prefill.plan / decode.plan)",
            lambda c, o: _export(c).get("format") == "tensorrt", "TensorRT"),
)


def find_runtime(backend: str, config: dict, options: LoadOptions) -> Runtime:
    """The first row serving under ``backend`` that recognises the artifact's config.json."""
    return next(r for r in RUNTIMES if r.serves(backend) and r.recognises(config, options))


def asked(options: LoadOptions) -> dict[str, str]:
    """The FEATURES ``options`` ask of a runtime, each with the setting that asks for it."""
    f = options.features
    wanted = {"tp": (options.tp > 1, f"tp={options.tp}"), "compile": (options.compile is True, "compile=True"),
              "native": (options.native is True, "native=True"),
              "prefix_cache": (bool(f.prefix_cache_mb), f"prefix_cache_mb={f.prefix_cache_mb}"),
              "draft": (f.draft is not None, f"draft={f.draft}"),
              "device_map": (options.device_map is not None, "device_map"),
              "prompt_graph": (bool(options.prompt_graph), "prompt_graph"),
              "kv_f16": (options.kv_dtype == "f16", "kv_dtype='f16'")}
    return {name: setting for name, (on, setting) in wanted.items() if on}


def _served_where(name: str) -> str:
    return "; ".join(r.loads for r in RUNTIMES if name in r.accepts)


def check_options(path: Path, backend: str, options: LoadOptions) -> None:
    """Every value of ``options`` well formed, then what they ask served by a runtime of ``backend``, all of it by
    one row: one line naming the setting, where it is served and the flag to drop (never ignored)."""
    from prunus.artifacts.errors import PrunusError

    options.check()
    wanted, rows = asked(options), [r for r in RUNTIMES if r.serves(backend)]
    for name, setting in wanted.items():
        if not any(name in r.accepts for r in rows):
            words, flag = FEATURES[name]
            raise PrunusError(f"{path}: {setting} asks for {words}, which the {backend} backend does not serve (only "
                              f"{_served_where(name)}); drop {flag}")
    if wanted and not any(set(wanted) <= r.accepts for r in rows):
        flags = " or ".join(FEATURES[n][1] for n in wanted)
        raise PrunusError(f"{path}: no runtime of the {backend} backend serves {' and '.join(wanted.values())} "
                          f"together; drop {flags}")


def check_accepted(path: Path, runtime: Runtime, wanted) -> None:
    """One line naming the first feature asked of ``runtime`` that its row does not declare, where it is served
    instead and the flag to drop (never ignored)."""
    for name in sorted(set(wanted) - runtime.accepts):
        from prunus.artifacts.errors import PrunusError

        words, flag = FEATURES[name]
        raise PrunusError(f"{path}: {words} is not served for {runtime.loads}, only for: {_served_where(name)}; "
                          f"drop {flag}")


def load_runtime(path: str | Path, backend: str | None, options: LoadOptions) -> Loaded:
    """The artifact at ``path`` (a model dir or an export dir) loaded by its runtime, every option checked first;
    ``backend=None`` picks the one the artifact needs. ``info`` holds what was loaded and how."""
    from dataclasses import replace

    from .artifact import resolve_backend

    path = Path(path)
    asked_backend = backend
    backend, config = resolve_backend(path, backend)
    check_options(path, backend, options)
    options = replace(options, max_len=options.max_len_for(config))
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
