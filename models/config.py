"""Model architecture as one validated value, plus named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import PrunusError


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
    # None: dim // n_heads. Set when attention heads were pruned away: the heads left keep their width.
    head_dim: int | None = None

    def __post_init__(self) -> None:
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
            raise PrunusError(f"model config: dtype={self.dtype!r} must be float32, bfloat16 or float16")
        self._validate_moe()

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
                              "lower --top-k or raise --n-experts")
        if self.moe_ffn_dim < 1:
            raise PrunusError(f"model config: moe_ffn_dim={self.moe_ffn_dim} must be a positive integer")
        if self.moe_aux_loss_coef < 0:
            raise PrunusError(f"model config: moe_aux_loss_coef={self.moe_aux_loss_coef} must not be negative")

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
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PrunusError(f"{source}: unknown model field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**d)

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count, computed from the shapes (no model built)."""
        hd = self.head_dim
        attn = self.dim * self.n_heads * hd * 2 + self.dim * self.n_kv_heads * hd * 2
        mlp = 3 * self.dim * self.ffn_dim
        if self.moe:  # router, the experts, the shared experts
            mlp = self.dim * self.n_experts + 3 * self.dim * self.moe_ffn_dim * (self.n_experts + self.n_shared_experts)
        per_layer = attn + mlp + 2 * self.dim
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
