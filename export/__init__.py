"""prunus.export: model dirs to ONNX Runtime and TensorRT export dirs, with KV-cache graphs and parity reports."""

from .export_dir import EXPORT_GRAPHS, FORMATS, PRECISIONS, ExportResult, export_model, load_export
from .ort_graphs import OrtGraphs
from .parity import TOLERANCES, ParityFailed, check_parity

__all__ = ["EXPORT_GRAPHS", "FORMATS", "PRECISIONS", "ExportResult", "export_model", "load_export", "OrtGraphs",
           "TOLERANCES", "ParityFailed", "check_parity"]
