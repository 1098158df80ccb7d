"""prunus.serve: the Engine API over every runtime of :mod:`prunus.runtime`; continuous batching; HTTP.

Public names are imported from their submodules on first use (:mod:`prunus.artifacts.lazy`), so that
the CLI can import this package without importing torch.
"""

from prunus.artifacts.lazy import lazy_package

_EXPORTS = {"Engine": "engine", "GenerationResult": "request", "SamplingParams": "request", "StreamToken": "request",
            "QueueFull": "scheduler"}
__all__ = list(_EXPORTS)
lazy_package(__name__, _EXPORTS)
