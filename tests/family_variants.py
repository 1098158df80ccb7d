"""The Hugging Face families as prunus ModelConfig changes of the ``tiny`` preset, for the stage tests.

Each entry turns on the fields that family's converter sets (``models/hf_families.py``), on the
tiny preset's shapes (dim 64, 4 heads / 2 kv heads, byte vocabulary 320, so the built-in corpus
and byte tokenizer work): the training, compression, export and serving tests parametrize over
these without going through transformers. ``family_model`` draws every weight at random, norms
and biases included (around 1, or around 0 for (1 + w) norms and biases), so a bias or norm that
a stage drops, shards wrongly or counts twice shows in the logits.

The variants (``WINDOW`` is shorter than the test sequences and generations):

* llama: Llama 3 rope scaling (llama3), tied embeddings, and ``attention_bias`` (q/k/v and o biases,
  as Llama-family checkpoints with ``attention_bias: true``): the row-parallel o bias;
* qwen2: q/k/v biases, yarn rope scaling;
* qwen3: per-head q/k RMSNorm, head_dim 32 != dim / heads, linear rope scaling;
* mistral: a sliding window on every layer, dynamic rope scaling;
* phi3: plain Llama once its fused projections are split on import (nothing else changes);
* gemma2: (1 + w) norms, sqrt(dim)-scaled embeddings, GELU-tanh, attention and final soft-capping,
  post norms, query_pre_attn_scalar, head_dim 16, alternating sliding / full layers, tied embeddings;
* mixtral: 4 routed experts, top 2, renormalised;
* qwen3_moe: q/k norms, head_dim 16, 4 experts of their own width, top 2, not renormalised.
"""

from __future__ import annotations

import torch

WINDOW = 6
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "mixtral", "qwen3_moe")
MOE = ("mixtral", "qwen3_moe")
SLIDING = ("mistral", "gemma2")


def family_fields(family: str, n_layers: int = 2, window: int = WINDOW) -> dict:
    """The ModelConfig fields (JSON-friendly: TrainConfig.model takes them) that make ``family`` on the tiny preset."""
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    table = {
        "llama": dict(rope_type="llama3", rope_theta=500000.0, rope_factor=8.0, rope_original_max_len=32,
                      tie_embeddings=True, attn_qkv_bias=True, attn_out_bias=True),
        "qwen2": dict(attn_qkv_bias=True, rope_type="yarn", rope_theta=1000000.0, rope_factor=4.0,
                      rope_original_max_len=32),
        "qwen3": dict(qk_norm=True, head_dim=32, rope_type="linear", rope_theta=1000000.0, rope_factor=2.0),
        "mistral": dict(sliding_window=window, rope_type="dynamic", rope_factor=2.0),
        "phi3": dict(),
        "gemma2": dict(head_dim=16, query_pre_attn_scalar=24.0, sliding_window=window, layer_types=alternating,
                       attn_softcap=5.0, final_softcap=3.0, hidden_act="gelu_pytorch_tanh", norm_one_plus_weight=True,
                       scale_embeddings=True, post_norms=True, tie_embeddings=True),
        "mixtral": dict(n_experts=4, top_k=2, moe_ffn_dim=96),
        "qwen3_moe": dict(qk_norm=True, head_dim=16, n_experts=4, top_k=2, moe_ffn_dim=48, moe_norm_topk=False),
    }
    return {"n_layers": n_layers, **table[family]}


def family_config(family: str, n_layers: int = 2, **changes):
    from prunus.models import get_preset

    return get_preset("tiny").replace(**{**family_fields(family, n_layers), **changes})


@torch.no_grad()
def randomize_vectors(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Draw the 1-D weights at random: biases in [-0.5, 0.5], norms in [0.5, 1.5] ((1 + w) norms in [-0.5, 0.5])."""
    gen = torch.Generator().manual_seed(seed)
    offset = model.config.norm_one_plus_weight
    for name, p in model.named_parameters():
        if p.ndim == 1:
            low = -0.5 if name.endswith("bias") or offset else 0.5
            p.copy_(torch.rand(p.shape, generator=gen) + low)
    return model


def family_model(family: str, n_layers: int = 2, seed: int = 0, **changes):
    """A seeded tiny random prunus Transformer of ``family`` in eval mode, every weight drawn (see the module doc)."""
    from prunus.models import Transformer

    torch.manual_seed(seed)
    model = Transformer(family_config(family, n_layers, **changes))
    model.init_weights(std=0.1)
    return randomize_vectors(model, seed).eval()
