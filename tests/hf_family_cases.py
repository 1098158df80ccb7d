"""The Hugging Face model families prunus converts, each as a function that builds a tiny random
transformers config (no download), so any test can parametrize over families.

Every config is small enough for a forward pass in milliseconds (hidden 64, 2 layers, 4 heads /
2 kv heads, vocab 320) and turns on what makes its family different: rope scaling, q/k/v biases,
q/k norms, an explicit head_dim, a tiny sliding window (a generation of 16+ tokens crosses it),
Gemma 2's alternating local / global layers and soft-capping, Phi-3's fused projections, and
routed experts. ``make_hf_model`` builds the seeded model with every weight random (norms and
biases too, so a swapped or dropped tensor shows in the logits).

Usage::

    from hf_family_cases import FAMILIES, make_hf_model
    @pytest.mark.parametrize("family", FAMILIES)
    def test_x(family, tmp_path): model = make_hf_model(family); model.save_pretrained(tmp_path)
"""

from __future__ import annotations

WINDOW = 6  # sliding window of the families that have one: shorter than the test generations
VOCAB = 320  # prunus's byte-level size: a model dir without tokenizer.json gets the byte tokenizer (257 ids)
SHAPES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-5,
              initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _t():
    import transformers

    return transformers


def llama():
    """Llama 3.x: llama3 rope scaling, tied embeddings (Llama 3.2 1B / 3B style)."""
    return _t().LlamaConfig(**SHAPES, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})


def qwen2():
    """Qwen2 / 2.5: q/k/v biases (no o bias), yarn rope scaling with its attention factor."""
    return _t().Qwen2Config(**SHAPES, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32})


def qwen3():
    """Qwen3: per-head q/k RMSNorm, head_dim 32 != hidden / heads, linear rope scaling."""
    return _t().Qwen3Config(**SHAPES, head_dim=32, rope_parameters={
        "rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0})


def mistral():
    """Mistral: sliding-window attention on every layer, dynamic (NTK) rope scaling."""
    return _t().MistralConfig(**SHAPES, sliding_window=WINDOW, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})


def phi3():
    """Phi-3: fused qkv_proj and gate_up_proj, default rope."""
    return _t().Phi3Config(**{**SHAPES, "pad_token_id": 3}, original_max_position_embeddings=128)


def gemma2():
    """Gemma 2: (1 + w) norms, sqrt(dim) embeddings, GELU-tanh, soft-capping, sandwich norms,
    query_pre_attn_scalar, alternating sliding / full layers."""
    return _t().Gemma2Config(**SHAPES, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                             attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                             hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)


def mixtral():
    """Mixtral: 4 routed experts, top 2, renormalised."""
    return _t().MixtralConfig(**SHAPES, num_local_experts=4, num_experts_per_tok=2)


def qwen3_moe():
    """Qwen3-MoE: q/k norms, 4 experts with their own hidden size, top 2, not renormalised."""
    return _t().Qwen3MoeConfig(**SHAPES, head_dim=16, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=48, norm_topk_prob=False)


FAMILIES = {f.__name__: f for f in (llama, qwen2, qwen3, mistral, phi3, gemma2, mixtral, qwen3_moe)}
SLIDING = ("mistral", "gemma2")  # families whose tiny config has a sliding window


def make_hf_model(family: str, *, dtype=None, seed: int = 0, **overrides):
    """A seeded tiny random ``AutoModelForCausalLM`` of ``family`` in eval mode.

    1-D weights (norms, biases) are drawn too: norms around 1 (around 0 for Gemma's 1 + w norms),
    biases around 0. ``overrides`` change the config (e.g. ``tie_word_embeddings``)."""
    import torch

    transformers = _t()
    cfg = FAMILIES[family]()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    impl = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                if name.endswith("bias"):
                    p.uniform_(-0.5, 0.5)
                elif family == "gemma2":
                    p.uniform_(-0.5, 0.5)
                else:
                    p.uniform_(0.5, 1.5)
    model = model.eval()
    if dtype is not None:
        model = model.to(dtype)
    return model
