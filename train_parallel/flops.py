"""Model FLOPs utilisation (MFU) and peak memory.

Training FLOPs per token = 6 * N + 12 * L * d * T, with N the parameters in
matmuls (all but the embedding lookup and norms), L blocks, d model width, T
sequence length: 6N for the forward and backward matmuls, 12LdT for attention
scores and values (PaLM, appendix B). MFU = tokens/s * FLOPs per token /
(ranks * peak FLOP/s per rank). The peak is known for common GPUs (dense bf16);
on CPUs pass it with --peak-tflops, or MFU is not reported.
"""

from __future__ import annotations

import resource
import sys

import torch

from prunus.models.config import ModelConfig

# dense bf16 tensor-core peaks, TFLOP/s
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0, "V100": 125.0}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    # mixture of experts: the parameters a token computes with (top_k of the routed experts)
    matmul_params = cfg.num_active_params(include_embedding=False) - cfg.dim * (2 * cfg.n_layers + 1)
    if cfg.tie_embeddings:
        matmul_params += cfg.vocab_size * cfg.dim  # the tied head is still a matmul
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * cfg.dim * seq_len


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given:
        return given
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_TFLOPS.items():
            if key in name:
                return value
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated memory on a GPU; on a CPU the process's peak resident set."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
