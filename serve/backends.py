"""The runtimes that serve a model, and which one serves each export format.

Kept apart from :mod:`prunus.serve.artifact` so that the CLI reads the names without importing torch.
"""

BACKENDS = ("torch", "onnxruntime", "tensorrt")
EXPORT_BACKEND = {"onnx": "onnxruntime", "tensorrt": "tensorrt"}
