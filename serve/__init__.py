"""prunus.serve: the Engine API over PyTorch, ONNX Runtime and TensorRT; continuous batching; TP workers; HTTP."""

from .engine import Engine
from .request import GenerationResult, SamplingParams, StreamToken
from .scheduler import QueueFull

__all__ = ["Engine", "GenerationResult", "SamplingParams", "StreamToken", "QueueFull"]
