"""The native runtime: a genai export's decode steps (and short int8 prompts) in prunus's own CPU kernels
(:mod:`prunus.native`: ``decode.c``, compiled on first use; AVX2, AVX-VNNI, AVX-512, AVX-512 VNNI or AMX linear
kernels, chosen from the CPU at load and named in the engine's info as ``native_isa``), over the same weights and
the same KV buffers as ONNX Runtime's graph, so the two take turns on one cache
(:class:`prunus.runtime.genai_session.GenaiSession` with ``native=True``; ``kv_dtype="f16"``: a float16 cache of
the native kernels' own); the backend is the genai one (:mod:`prunus.runtime.ort_genai`). Each linear layer groups
its rows as measured on this machine (:mod:`prunus.native.plan`, cached; the info's ``native_plan``).

The weights are the export's own numbers, read from the ``native_weights.safetensors`` it wrote beside its graph
from the model dir's stored codes (:mod:`prunus.native.weights`); the graph itself is never parsed for them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from prunus.native.build import isa
from prunus.native.decoder import NativeDecoder, check_native, native_prompt_tokens  # noqa: F401  (the runtime's API)
from prunus.native.weights import PackedModel

from .load_options import LoadOptions
from .native_decoder import native_decoder, pack_export  # noqa: F401  (the runtime's API)
from .ort_genai import GenaiBackend  # noqa: F401  (the backend this runtime loads)
from .registry import Loaded


def every_position_logits(packed: PackedModel, dims: dict, tokens: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """tokens (batch, seq) -> logits (batch, seq, vocab) of every position, through a scratch cache of its own."""
    b, s = tokens.shape
    shape = (b, dims["n_kv_heads"], s, dims["head_dim"])
    k, v = ([np.zeros(shape, np.float32) for _ in range(dims["n_layers"])] for _ in range(2))
    decoder = NativeDecoder(packed, k, v, b, s, threads)
    try:
        logits = np.empty((b * s, dims["vocab_size"]), np.float32)
        decoder.forward(tokens.long().numpy(), np.zeros(b, np.int32), np.full(b, s, np.int32), 0, logits,
                        every_position=True)
    finally:
        decoder.close()
    return torch.from_numpy(logits.reshape(b, s, -1))


def load(path: Path, config: dict, options: LoadOptions) -> Loaded:
    """An ONNX genai export dir whose decode steps run natively (``native=True``)."""
    from .ort_genai import load_genai

    check_native(str(path))
    loaded = load_genai(path, config, options, native=True)
    loaded.info["native_isa"] = isa()  # the kernel path the CPU (or PRUNUS_NATIVE_ISA) chose
    native = getattr(getattr(loaded.backend, "session", None), "native", None)
    if native is not None and native.plan is not None:
        loaded.info["native_plan"] = native.plan.how  # calibrated / cached / default, and why
    return loaded
