"""The backends ``--backend`` names, and which one an export dir's format needs (torch-free: the CLI reads them)."""

from __future__ import annotations

BACKENDS = ("torch", "onnxruntime", "tensorrt")  # what --backend names
EXPORT_BACKEND = {"onnx": "onnxruntime", "tensorrt": "tensorrt"}  # an export dir's format -> the backend it needs
