"""What an export can be: its formats and its weight precisions (read by the CLI without importing torch)."""

FORMATS = ("onnx", "tensorrt")
PRECISIONS = ("fp32", "fp16", "int8", "fp8", "int4")
# genai: one graph around ONNX Runtime's fused operators (prunus.export.genai_graph); torch: torch.onnx.export's two
GRAPHS = ("genai", "torch")
