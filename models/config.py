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

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.ffn_dim is None:
            object.__setattr__(self, "ffn_dim", _swiglu_hidden(self.dim))
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PrunusError(f"model config: {name}={value!r} must be a positive integer")
        if self.dim % self.n_heads:
            raise PrunusError(f"model config: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise PrunusError(
                f"model config: n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise PrunusError(f"model config: head_dim={self.head_dim} must be even for rotary embeddings")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise PrunusError(f"model config: dtype={self.dtype!r} must be float32, bfloat16 or float16")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def replace(self, **changes) -> "ModelConfig":
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
        per_layer = attn + mlp + 2 * self.dim
        emb = self.vocab_size * self.dim
        out = 0 if self.tie_embeddings else self.vocab_size * self.dim
        total = self.n_layers * per_layer + self.dim + out
        return total + (emb if include_embedding else 0)


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
