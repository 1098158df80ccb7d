"""The Hugging Face model families prunus converts, as data: for each ``model_type``, how its
config.json maps onto :class:`ModelConfig` (both ways) and how its tensor names map onto
prunus's. A family is a converter, never a second model: every one of them builds the same
``models/llama.py`` Transformer, its differences being ModelConfig fields.

Supported: llama, qwen2, qwen3, mistral, phi3, gemma2, mixtral, qwen3_moe. Refused in one line:
any other model_type, and within a family: rope types other than default / linear / dynamic /
yarn / llama3 (e.g. Phi-3's longrope), partial rotary embeddings, activations other than the
family's, MLP biases, Qwen3-MoE layouts mixing dense and MoE blocks (mlp_only_layers,
decoder_sparse_step != 1), bidirectional Gemma attention.

Tensors are only renamed, split or joined (Phi-3's fused qkv_proj / gate_up_proj; per-expert
MoE weights stacked and transposed into ``GroupedExperts``), never cast, so a round trip is
bit-exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .config import ROPE_TYPES, ModelConfig
from prunus.artifacts.errors import PrunusError

LAYER = {  # a Llama block's tensors, Hugging Face name -> prunus name
    "self_attn.q_proj.weight": "attention.wq.weight", "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight", "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_proj.bias": "attention.wq.bias", "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias", "self_attn.o_proj.bias": "attention.wo.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight", "self_attn.k_norm.weight": "attention.k_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight", "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "input_layernorm.weight": "attention_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
}
GEMMA_NORMS = {"post_attention_layernorm.weight": "attention_post_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "ffn_post_norm.weight"}
TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
       "lm_head.weight": "output.weight"}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
# ModelConfig fields a family's config.json does not carry (training settings, the stored dtype)
NOT_IN_HF = ("dtype", "capacity_factor")


@dataclass(frozen=True)
class Family:
    """One Hugging Face ``model_type``: its config keys (``config_in`` / ``config_out``, beside the
    keys every family shares) and its block tensor names."""

    model_type: str
    architecture: str
    config_in: Callable[[dict], dict]  # family keys of config.json -> ModelConfig fields
    config_out: Callable[[ModelConfig], dict]  # ModelConfig -> family keys of config.json
    defaults: dict = field(default_factory=dict)  # transformers' defaults for keys an older config.json lacks
    layer: dict = field(default_factory=lambda: dict(LAYER))
    fused: bool = False  # Phi-3: qkv_proj and gate_up_proj
    experts: tuple[str, str, str, str] | None = None  # MoE: (block prefix, gate, down, up name of one expert)


def _refuse(hf: dict, what: str) -> PrunusError:
    return PrunusError(f"unsupported {hf.get('model_type')} feature {what}; prunus converts the families "
                       f"{', '.join(FAMILIES)} without it")


def _window_all(hf: dict) -> dict:
    """Mistral-style: one sliding window on every layer (null: none)."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    return {"sliding_window": window}


def _window_per_layer(hf: dict, every_other: bool = False) -> dict:
    """Qwen2 / Qwen3 / Gemma 2: a window on the layers layer_types marks as sliding."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if window is None:
        return {"sliding_window": None, "layer_types": None}
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None and every_other:  # Gemma 2's default: local, global, local, ...
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    elif types is None:
        first = hf.get("max_window_layers", n)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return {"sliding_window": window, "layer_types": tuple(types)}


def _window_out(cfg: ModelConfig, qwen: bool) -> dict:
    out = {"sliding_window": cfg.sliding_window}
    if cfg.layer_types is not None or qwen:
        types = list(cfg.layer_types or ["sliding_attention" if cfg.sliding_window else "full_attention"] * cfg.n_layers)
        out["layer_types"] = types
    if qwen:
        sliding = [i for i, t in enumerate(out["layer_types"]) if t == "sliding_attention"]
        out["use_sliding_window"] = cfg.sliding_window is not None
        out["max_window_layers"] = sliding[0] if sliding else cfg.n_layers
    return out


def _bias_in(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return {"attn_qkv_bias": bias, "attn_out_bias": bias}


def _bias_out(cfg: ModelConfig) -> dict:
    return {"attention_bias": cfg.attn_qkv_bias}


def _check_act(hf: dict, key: str = "hidden_act", allowed: str = "silu") -> None:
    if hf.get(key, allowed) != allowed:
        raise _refuse(hf, f"{key}={hf[key]!r} (only {allowed})")


def _llama_in(hf: dict) -> dict:
    _check_act(hf)
    if hf.get("mlp_bias"):
        raise _refuse(hf, "mlp_bias=true")
    return _bias_in(hf)


def _qwen2_in(hf: dict) -> dict:
    _check_act(hf)
    return {"attn_qkv_bias": True, **_window_per_layer(hf)}


def _qwen3_in(hf: dict) -> dict:
    _check_act(hf)
    return {"qk_norm": True, **_bias_in(hf), **_window_per_layer(hf)}


def _mistral_in(hf: dict) -> dict:
    _check_act(hf)
    return _window_all(hf)


def _phi3_in(hf: dict) -> dict:
    _check_act(hf)
    return _window_all(hf)


def _gemma2_in(hf: dict) -> dict:
    _check_act(hf, "hidden_activation", "gelu_pytorch_tanh")
    if hf.get("use_bidirectional_attention"):
        raise _refuse(hf, "use_bidirectional_attention=true")
    return {"hidden_act": "gelu_pytorch_tanh", "norm_one_plus_weight": True, "scale_embeddings": True,
            "post_norms": True, "query_pre_attn_scalar": hf.get("query_pre_attn_scalar"),
            "attn_softcap": hf.get("attn_logit_softcapping"), "final_softcap": hf.get("final_logit_softcapping"),
            **_bias_in(hf), **_window_per_layer(hf, every_other=True)}


def _gemma2_out(cfg: ModelConfig) -> dict:
    return {"hidden_activation": cfg.hidden_act, "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
            "attn_logit_softcapping": cfg.attn_softcap, "final_logit_softcapping": cfg.final_softcap,
            **_bias_out(cfg), **_window_out(cfg, qwen=False)}


def _moe_in(hf: dict, n_experts: int, hidden: int) -> dict:
    return {"n_experts": n_experts, "top_k": hf.get("num_experts_per_tok", 2), "moe_ffn_dim": hidden,
            "moe_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001))}


def _mixtral_in(hf: dict) -> dict:
    _check_act(hf)
    return {**_moe_in(hf, hf.get("num_local_experts", 8), hf["intermediate_size"]), **_window_all(hf)}


def _mixtral_out(cfg: ModelConfig) -> dict:
    return {"num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k, "intermediate_size": cfg.moe_ffn_dim,
            "router_aux_loss_coef": cfg.moe_aux_loss_coef, "sliding_window": cfg.sliding_window}


def _qwen3_moe_in(hf: dict) -> dict:
    _check_act(hf)
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise _refuse(hf, f"mlp_only_layers={hf.get('mlp_only_layers')} / decoder_sparse_step="
                          f"{hf.get('decoder_sparse_step')} (dense blocks between MoE blocks)")
    n = hf.get("num_experts", hf.get("num_local_experts", 128))
    return {**_moe_in(hf, n, hf["moe_intermediate_size"]), "moe_norm_topk": bool(hf.get("norm_topk_prob", False)),
            "qk_norm": True, **_bias_in(hf), **_window_all(hf)}


def _qwen3_moe_out(cfg: ModelConfig) -> dict:
    return {"num_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k, "moe_intermediate_size": cfg.moe_ffn_dim,
            "norm_topk_prob": cfg.moe_norm_topk, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "router_aux_loss_coef": cfg.moe_aux_loss_coef, "use_sliding_window": cfg.sliding_window is not None,
            "sliding_window": cfg.sliding_window, **_bias_out(cfg)}


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", _llama_in, lambda c: {**_bias_out(c), "mlp_bias": False, "hidden_act": "silu"}),
    Family("qwen2", "Qwen2ForCausalLM", _qwen2_in, lambda c: {"hidden_act": "silu", **_window_out(c, qwen=True)},
           defaults={"max_window_layers": 28}),
    Family("qwen3", "Qwen3ForCausalLM", _qwen3_in,
           lambda c: {"hidden_act": "silu", **_bias_out(c), **_window_out(c, qwen=True)},
           defaults={"head_dim": 128, "max_window_layers": 28}),
    Family("mistral", "MistralForCausalLM", _mistral_in, lambda c: {"hidden_act": "silu", "sliding_window": c.sliding_window}),
    Family("phi3", "Phi3ForCausalLM", _phi3_in,
           lambda c: {"hidden_act": "silu", "sliding_window": c.sliding_window,
                      "original_max_position_embeddings": c.rope_original_max_len or c.max_seq_len},
           defaults={"rms_norm_eps": 1e-5}, fused=True),
    Family("gemma2", "Gemma2ForCausalLM", _gemma2_in, _gemma2_out,
           defaults={"head_dim": 256, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                     "final_logit_softcapping": 30.0, "sliding_window": 4096, "tie_word_embeddings": True},
           layer={**LAYER, **GEMMA_NORMS}),
    Family("mixtral", "MixtralForCausalLM", _mixtral_in, _mixtral_out, defaults={"rms_norm_eps": 1e-5},
           experts=("block_sparse_moe", "w1", "w2", "w3")),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe_in, _qwen3_moe_out,
           experts=("mlp", "gate_proj", "down_proj", "up_proj")),
)}


def get_family(model_type, architectures=None, where: str | None = None) -> Family:
    fam = FAMILIES.get(model_type)
    if fam is None:
        arch = f" (architectures {architectures})" if architectures else ""
        raise PrunusError(f"{where + ': ' if where else ''}model_type {model_type!r}{arch} is not supported; "
                          f"prunus converts {', '.join(FAMILIES)}")
    return fam


# ---- config.json <-> ModelConfig -------------------------------------------------------------

def _rope_in(hf: dict) -> dict:
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rtype = rope.get("rope_type", rope.get("type", "default"))
    if rtype not in ROPE_TYPES:
        raise _refuse(hf, f"rope_type={rtype!r} (prunus has {', '.join(ROPE_TYPES)})")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _refuse(hf, "partial_rotary_factor != 1 (partial rotary embeddings)")
    out = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), "rope_type": rtype}
    if rtype == "default":
        return out
    original = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    if rtype == "dynamic" or original is None:
        original = hf.get("max_position_embeddings", 2048)
    factor = rope.get("factor")
    if factor is None and rtype == "yarn":  # DeepSeek style: the ratio of the contexts
        factor = hf.get("max_position_embeddings", 2048) / original
    out.update(rope_factor=float(factor if factor is not None else 1.0), rope_original_max_len=int(original))
    if rtype == "llama3":
        out.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                   rope_high_freq_factor=float(rope["high_freq_factor"]))
    if rtype == "yarn":
        out.update(rope_beta_fast=float(rope.get("beta_fast") or 32), rope_beta_slow=float(rope.get("beta_slow") or 1),
                   rope_attention_factor=rope.get("attention_factor"), rope_mscale=rope.get("mscale"),
                   rope_mscale_all_dim=rope.get("mscale_all_dim"), rope_truncate=bool(rope.get("truncate", True)))
    return out


def _rope_out(cfg: ModelConfig) -> dict:
    rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type != "default":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type in ("llama3", "yarn"):
        rope["original_max_position_embeddings"] = cfg.rope_original_max_len
    if cfg.rope_type == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    if cfg.rope_type == "yarn":
        rope.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow, truncate=cfg.rope_truncate)
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(cfg, f"rope_{key}") is not None:
                rope[key] = getattr(cfg, f"rope_{key}")
    # rope_parameters is what transformers 5 reads; rope_theta / rope_scaling what transformers 4 reads
    out = {"rope_parameters": rope, "rope_theta": cfg.rope_theta}
    if cfg.rope_type != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def config_from_hf(hf: dict, dtype: str) -> tuple[Family, ModelConfig]:
    """The family and the ModelConfig of a Hugging Face config.json (raises PrunusError, KeyError)."""
    fam = get_family(hf.get("model_type"), hf.get("architectures"))
    hf = {**fam.defaults, **hf}
    heads = hf["num_attention_heads"]
    fields = dict(
        dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        head_dim=hf.get("head_dim") or None, dtype=dtype, **_rope_in(hf), **fam.config_in(hf),
    )
    return fam, ModelConfig(**fields)


def config_to_hf(fam: Family, cfg: ModelConfig) -> dict:
    """The family's config.json for ``cfg`` (token ids and dtype are added by the caller)."""
    return {
        "architectures": [fam.architecture], "model_type": fam.model_type,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, **_rope_out(cfg), **fam.config_out(cfg),
    }


def inexpressible(fam: Family, cfg: ModelConfig) -> list[str]:
    """The ModelConfig fields whose values ``fam`` cannot write (its config.json would read back otherwise)."""
    if bool(fam.experts) != bool(cfg.n_experts):
        return [f"n_experts={cfg.n_experts}"]
    try:
        _, back = config_from_hf(config_to_hf(fam, cfg), cfg.dtype)
    except PrunusError as e:
        return [str(e)]
    skip = set(NOT_IN_HF) | ({f.name for f in dataclasses.fields(cfg) if f.name.startswith("moe_") or f.name == "top_k"}
                             if not cfg.n_experts else set())
    if cfg.n_experts:
        skip.add("ffn_dim")  # unused by MoE blocks
    return [f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)
            if f.name not in skip and getattr(cfg, f.name) != getattr(back, f.name)]
