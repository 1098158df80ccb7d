"""Model architecture as one validated value, plus named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import check_dataclass, check_known_fields, short


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


MAX_SEQ_LEN = 1 << 20  # the rotary tables of a longer context alone take gigabytes
MAX_SIZE = 1 << 24  # any size or count of the architecture: far above every real model, and the products of a
# few such sizes stay within torch's 64-bit element counts (a config of 2**64 experts is one line, not an overflow)
_SIZES = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "n_experts", "top_k", "n_shared_experts",
          "moe_ffn_dim", "head_dim", "rope_original_max_len", "sliding_window")


def _swiglu_hidden(dim: int, multiple_of: int = 64) -> int:
    hidden = int(2 * (4 * dim) / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder. ``n_kv_heads < n_heads`` is grouped-query attention."""

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: same as n_heads
    ffn_dim: int | None = None  # None: SwiGLU's 8/3 * dim, rounded up to 64
    vocab_size: int = 320
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "float32"  # the dtype the weights are stored and loaded in
    # mixture of experts (models/moe.py): n_experts=0 is a dense SwiGLU in every block
    n_experts: int = 0
    top_k: int = 2  # experts per token
    capacity_factor: float | None = None  # None or <= 0: no token is dropped
    moe_aux_loss_coef: float = 0.01  # load-balancing loss (Switch / GShard), added to the training loss
    n_shared_experts: int = 0  # experts every token goes through, beside the routed ones
    moe_ffn_dim: int | None = None  # each expert's hidden size; None: ffn_dim
    # None: dim // n_heads. Set when attention heads were pruned away, or by a family (Qwen3, Gemma) whose heads are wider.
    head_dim: int | None = None
    # --- architecture variants of the Hugging Face families (models/hf_families.py). The defaults are plain Llama.
    # rotary scaling (models/rope.py), numerically as transformers' modeling_rope_utils:
    # "default" | "linear" | "dynamic" | "yarn" | "llama3"
    rope_type: str = "default"
    rope_factor: float = 1.0  # linear / dynamic / yarn / llama3: the context extension factor
    rope_original_max_len: int | None = None  # yarn / llama3 / dynamic: the pre-training context the scaling extends
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_beta_fast: float = 32.0  # yarn: correction range bounds
    rope_beta_slow: float = 1.0  # yarn
    rope_attention_factor: float | None = None  # yarn: cos/sin multiplier; None: from rope_factor (and the mscales)
    rope_mscale: float | None = None  # yarn (DeepSeek style): with rope_mscale_all_dim, sets the attention factor
    rope_mscale_all_dim: float | None = None  # yarn
    rope_truncate: bool = True  # yarn: round the correction range to whole dimensions
    attn_qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2 / 2.5)
    attn_out_bias: bool = False  # a bias on the output projection (Llama's attention_bias sets both)
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before the rotary embedding (Qwen3)
    # sliding-window attention: a query sees the keys fewer than sliding_window positions back (itself included),
    # on every layer (Mistral) or on the layers whose layer_types entry is "sliding_attention" (Gemma 2, Qwen2/3)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # per layer "full_attention" | "sliding_attention"; None: all alike (sliding if a window is set)
    attn_softcap: float | None = None  # attention scores -> softcap * tanh(scores / softcap) (Gemma 2)
    final_softcap: float | None = None  # logits -> softcap * tanh(logits / softcap) (Gemma 2)
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5
    hidden_act: str = "silu"  # the gate's activation: "silu" | "gelu_pytorch_tanh" (Gemma)
    norm_one_plus_weight: bool = False  # RMSNorm scales by (1 + weight), in fp32 (Gemma); weights stored as is
    scale_embeddings: bool = False  # token embeddings times sqrt(dim), rounded to the weights' dtype (Gemma)
    post_norms: bool = False  # RMSNorm on the attention and feed-forward outputs before the residual add (Gemma 2)
    moe_norm_topk: bool = True  # renormalise the top_k router weights to sum to one (Qwen3-MoE's norm_topk_prob)

    def __post_init__(self) -> None:
        self._check_types()
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.ffn_dim is None:
            object.__setattr__(self, "ffn_dim", _swiglu_hidden(self.dim))
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PrunusError(f"model config: {name}={value!r} must be a positive integer")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise PrunusError(f"model config: dim={self.dim} is not divisible by n_heads={self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        elif not isinstance(self.head_dim, int) or isinstance(self.head_dim, bool) or self.head_dim < 1:
            raise PrunusError(f"model config: head_dim={self.head_dim!r} must be a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise PrunusError(
                f"model config: n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise PrunusError(f"model config: head_dim={self.head_dim} must be even for rotary embeddings")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise PrunusError(f"model config: dtype={short(self.dtype)} must be float32, bfloat16 or float16")
        self._validate_moe()
        self._validate_variants()

    def _check_types(self) -> None:
        """Every field against its annotation (a field added later too; prunus.artifacts.validate), and the
        ranges the blocks assume: positive norm_eps and rope_theta, a context the rotary tables can hold."""
        check_dataclass(self, "model config")
        for name in ("norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise PrunusError(f"model config: {name}={getattr(self, name)!r} must be a positive number")
        if self.max_seq_len > MAX_SEQ_LEN:
            raise PrunusError(f"model config: max_seq_len={self.max_seq_len} is above {MAX_SEQ_LEN:,} tokens")
        for name in _SIZES:
            value = getattr(self, name)
            if isinstance(value, int) and value > MAX_SIZE:
                raise PrunusError(f"model config: {name}={short(value)} is above {MAX_SIZE:,}, more than any model holds")

    def _validate_moe(self) -> None:
        if self.moe_ffn_dim is None:
            object.__setattr__(self, "moe_ffn_dim", self.ffn_dim)
        for name in ("n_experts", "top_k", "n_shared_experts", "moe_ffn_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PrunusError(f"model config: {name}={value!r} must be a non-negative integer")
        if self.n_experts == 0:
            return
        if not 1 <= self.top_k <= self.n_experts:
            raise PrunusError(f"model config: top_k={self.top_k} must be between 1 and n_experts={self.n_experts}; "
                              "lower top_k (prunus train --moe-top-k) or raise n_experts")
        if self.moe_ffn_dim < 1:
            raise PrunusError(f"model config: moe_ffn_dim={self.moe_ffn_dim} must be a positive integer")
        if self.moe_aux_loss_coef < 0:
            raise PrunusError(f"model config: moe_aux_loss_coef={self.moe_aux_loss_coef} must not be negative")

    def _validate_variants(self) -> None:
        def bad(name: str, why: str) -> PrunusError:
            return PrunusError(f"model config: {name}={short(getattr(self, name))} {why}")

        if self.rope_type not in ROPE_TYPES:
            raise bad("rope_type", f"is not one of {', '.join(ROPE_TYPES)}")
        if not isinstance(self.rope_factor, (int, float)) or isinstance(self.rope_factor, bool) or self.rope_factor <= 0:
            raise bad("rope_factor", "must be a positive number")
        if self.rope_type in ("yarn", "llama3", "dynamic"):
            if self.rope_original_max_len is None:  # transformers' default: the model's own context
                object.__setattr__(self, "rope_original_max_len", self.max_seq_len)
        if self.rope_original_max_len is not None and (
                not isinstance(self.rope_original_max_len, int) or self.rope_original_max_len < 1):
            raise bad("rope_original_max_len", "must be a positive integer or null")
        if self.rope_type == "llama3" and not self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise bad("rope_low_freq_factor", f"must be below rope_high_freq_factor={self.rope_high_freq_factor}")
        if self.rope_type == "dynamic" and self.head_dim <= 2:
            raise bad("head_dim", "must be above 2 for dynamic rope scaling")
        for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar", "rope_attention_factor"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                raise bad(name, "must be a positive number or null")
        if self.hidden_act not in HIDDEN_ACTS:
            raise bad("hidden_act", f"is not one of {', '.join(HIDDEN_ACTS)}")
        if self.n_experts and self.hidden_act != "silu":
            raise bad("hidden_act", "is not supported by mixture-of-experts blocks (their experts are SwiGLU)")
        if self.sliding_window is not None and (
                not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise bad("sliding_window", "must be a positive integer or null")
        if self.layer_types is not None:
            types = tuple(self.layer_types) if isinstance(self.layer_types, (list, tuple)) else None
            if types is None or len(types) != self.n_layers or not set(types) <= set(LAYER_TYPES):
                raise bad("layer_types", f"must list one of {' / '.join(LAYER_TYPES)} for each of the {self.n_layers} "
                          "layers (after removing layers, use ModelConfig.keep_layers)")
            # every layer sliding is what None already says: one spelling, so equal models compare equal
            object.__setattr__(self, "layer_types", None if set(types) == {"sliding_attention"} else types)
        for name in ("attn_qkv_bias", "attn_out_bias", "qk_norm", "norm_one_plus_weight", "scale_embeddings",
                     "post_norms", "moe_norm_topk", "rope_truncate"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of block ``layer_id`` (its index in the original model), or None: full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer_id] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def attn_scale(self) -> float:
        """The factor on q k^T: query_pre_attn_scalar ** -0.5 where set, else head_dim ** -0.5 (as transformers)."""
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    def keep_layers(self, kept: list[int]) -> "ModelConfig":
        """The config of this model with only blocks ``kept`` (original indices, in order), renumbered 0..n-1:
        per-layer settings (layer_types) follow their blocks."""
        types = None if self.layer_types is None else tuple(self.layer_types[i] for i in kept)
        return self.replace(n_layers=len(kept), layer_types=types)

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    def replace(self, **changes) -> "ModelConfig":
        """A copy with ``changes``. A head_dim equal to dim // n_heads counts as derived and
        follows new dim / n_heads values; any other head_dim is kept unless changed."""
        if "head_dim" not in changes and self.head_dim == self.dim // self.n_heads:
            changes["head_dim"] = None
        if "moe_ffn_dim" not in changes and self.moe_ffn_dim == self.ffn_dim:
            changes["moe_ffn_dim"] = None  # derived: follows a new ffn_dim
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "model config") -> "ModelConfig":
        check_known_fields(d, cls, source, what="model field")  # prunus.artifacts.validate
        try:
            return cls(**d)
        except PrunusError as e:  # name the file the bad value came from
            if source == "model config":
                raise
            raise PrunusError(f"{source}: {str(e).removeprefix('model config: ')}") from None

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count, computed from the shapes (no model built)."""
        hd = self.head_dim
        attn = self.dim * self.n_heads * hd * 2 + self.dim * self.n_kv_heads * hd * 2
        attn += (self.n_heads + 2 * self.n_kv_heads) * hd * self.attn_qkv_bias + self.dim * self.attn_out_bias
        attn += 2 * hd * self.qk_norm
        mlp = 3 * self.dim * self.ffn_dim
        if self.moe:  # router, the experts, the shared experts
            mlp = self.dim * self.n_experts + 3 * self.dim * self.moe_ffn_dim * (self.n_experts + self.n_shared_experts)
        per_layer = attn + mlp + (4 if self.post_norms else 2) * self.dim
        emb = self.vocab_size * self.dim
        out = 0 if self.tie_embeddings else self.vocab_size * self.dim
        total = self.n_layers * per_layer + self.dim + out
        return total + (emb if include_embedding else 0)

    def num_active_params(self, include_embedding: bool = True) -> int:
        """Parameters one token computes with: the router, top_k routed and the shared experts of each block."""
        idle = 3 * self.dim * self.moe_ffn_dim * (self.n_experts - self.top_k) if self.moe else 0
        return self.num_params(include_embedding) - self.n_layers * idle


# Presets. Byte-level presets use vocab 320: 256 bytes + end-of-text, padded to a
# multiple of 64 so the vocabulary splits evenly under tensor parallelism.
PRESETS: dict[str, ModelConfig] = {
    # for tests: a forward pass in milliseconds
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=128),
    # for the demo: trains to well below the unigram baseline in minutes on 2 CPU cores
    "small": ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=256),
    # byte-level, for a single GPU
    "base": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, max_seq_len=1024),
    # Llama-3.2-1B and Llama-3.1-8B shapes (use with their Hugging Face tokenizer)
    "llama-1b": ModelConfig(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
        max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True, dtype="bfloat16",
    ),
    "llama-8b": ModelConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
        max_seq_len=8192, rope_theta=500000.0, dtype="bfloat16",
    ),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise PrunusError(f"unknown preset '{name}'; choose one of: {', '.join(PRESETS)}") from None
