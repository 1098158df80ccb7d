"""Everything ``Engine.load`` takes, as one object: which backend, what the runtime loads with
(:class:`prunus.runtime.load_options.LoadOptions`, its serving features included) and what the engine around it
runs with (queue, dynamic-batching delay, LoRA adapters, a prepare step).

``Engine.load(path, options=EngineOptions(...))`` and ``Engine.load(path, tp=2, max_batch=4, ...)`` are the same
call: :meth:`EngineOptions.from_keywords` sorts flat keywords into the object, so the CLI, the Ray replicas and
the Python API build one thing and check it in one place. A keyword that is no field of any part is a TypeError
naming it, as for any Python call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from prunus.runtime.load_options import LoadOptions, ServingFeatures

LOAD_FIELDS = tuple(f.name for f in dataclasses.fields(LoadOptions) if f.name != "features")
FEATURE_FIELDS = tuple(f.name for f in dataclasses.fields(ServingFeatures))


@dataclass(frozen=True)
class EngineOptions:
    """``backend``: None (the one the artifact needs), "torch", "onnxruntime" or "tensorrt". ``load``: what the
    runtime is loaded with (see ``Engine.load``'s keywords). ``max_queue``: requests waiting at most (None:
    unbounded). ``max_delay_ms``: how long a generic model's first caller waits for others to share its pass.
    ``lora``: {name: PEFT adapter dir}. ``prepare``: ``prepare(path, backend, options, has_lora) -> (path,
    info)``, run before the load (``prunus serve`` serves a model dir on a CPU from its cached genai export)."""

    backend: str | None = None
    load: LoadOptions = LoadOptions()
    max_queue: int | None = None
    max_delay_ms: float = 2.0
    lora: dict | None = None
    prepare: Callable | None = field(default=None, compare=False)

    @classmethod
    def from_keywords(cls, backend: str | None = None, **keywords) -> "EngineOptions":
        """The object of ``Engine.load``'s flat keywords (LoadOptions' and ServingFeatures' fields and this
        class's own)."""
        own = {f.name for f in dataclasses.fields(cls)} - {"backend", "load"}
        unknown = sorted(set(keywords) - set(LOAD_FIELDS) - set(FEATURE_FIELDS) - own)
        if unknown:
            raise TypeError(f"Engine.load() got an unexpected keyword argument {unknown[0]!r}")
        features = ServingFeatures(**{k: keywords[k] for k in FEATURE_FIELDS if k in keywords})
        load = LoadOptions(**{k: keywords[k] for k in LOAD_FIELDS if k in keywords}, features=features)
        return cls(backend, load, **{k: keywords[k] for k in own if k in keywords})

    @property
    def features(self) -> ServingFeatures:
        return self.load.features


__all__ = ["EngineOptions"]
