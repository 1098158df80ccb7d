"""prunus.runtime: the runtime floor under serving. One :class:`~prunus.runtime.backend.Backend` contract and
one module per runtime: torch (in-process), torch_tp (worker processes), ort_graphs (ONNX Runtime over the torch
graphs), ort_genai (ONNX Runtime over the genai graph), native (prunus's own CPU kernels), tensorrt; the table
of them is :mod:`prunus.runtime.registry`.

Public names are imported from their submodules on first use (:mod:`prunus.artifacts.lazy`), so that the CLI
can read :data:`prunus.runtime.registry.BACKENDS` without importing torch.
"""

from prunus.artifacts.lazy import lazy_package

_EXPORTS = {"Backend": "backend", "Capabilities": "backend", "BACKENDS": "registry", "RUNTIMES": "registry",
            "LoadOptions": "load_options", "load_runtime": "registry", "sample": "sampling"}
__all__ = list(_EXPORTS)
lazy_package(__name__, _EXPORTS)
