"""prunus.export: model dirs to ONNX Runtime and TensorRT export dirs, with KV-cache graphs and parity reports.

Public names are imported from their submodules on first use (:mod:`prunus.artifacts.lazy`), so that
the CLI can read the formats and precisions (:mod:`prunus.export.formats`) without importing torch.
"""

from prunus.artifacts.lazy import lazy_package

_EXPORTS = {
    "EXPORT_GRAPHS": "export_dir", "FORMATS": "formats", "PRECISIONS": "formats", "ExportResult": "export_manifest",
    "export_model": "export_dir", "load_export": "export_dir", "TOLERANCES": "parity",
    "ParityFailed": "parity", "check_parity": "parity", "GRAPHS": "formats",
    "export_graphs": "backend_parity",
    "GENAI_GRAPH": "genai_graph", "prepared_path": "prepared",
}
__all__ = list(_EXPORTS)
lazy_package(__name__, _EXPORTS)
