"""Rotary embedding tables, with the rope scalings of the Hugging Face families.

Each ``rope_type`` computes its inverse frequencies with the same expressions, in the
same order and dtypes, as ``transformers.modeling_rope_utils``, so the tables are
equal to transformers' to the bit:

* ``default``: 1 / theta^(2i/d);
* ``linear``: default / factor (positions interpolated);
* ``llama3``: Llama 3.1's frequency-dependent scaling (low frequencies / factor,
  high frequencies kept, a smooth ramp between), relative to the original context;
* ``yarn``: NTK-by-parts interpolation with its correction range (beta_fast,
  beta_slow) and an attention factor that multiplies cos and sin (as transformers
  applies it), from ``rope_attention_factor`` or else from the factor and the mscales;
* ``dynamic`` (dynamic NTK): positions below ``rope_original_max_len`` use the
  default frequencies, exactly as transformers does for any sequence within the
  original context. Beyond it transformers re-rotates the whole sequence with a base
  grown for the current length, which a cache of already rotated keys cannot follow;
  prunus instead rotates each position p >= rope_original_max_len with the
  frequencies transformers would use for a sequence of p + 1 tokens (base grown for
  length p + 1). That table is fixed, so a KV cache stays consistent, and the last
  position of a sequence always matches transformers' rotation of it.

cos and sin are (max_len, head_dim) in fp32, "rotate half" layout.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def _default_inv_freq(theta: float, dim: int, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def _llama3(cfg: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_len
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """The factor yarn multiplies cos and sin by (transformers' ``attention_factor``)."""
    if cfg.rope_attention_factor is not None:
        return float(cfg.rope_attention_factor)

    def mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return float(mscale(cfg.rope_factor, cfg.rope_mscale) / mscale(cfg.rope_factor, cfg.rope_mscale_all_dim))
    return mscale(cfg.rope_factor)


def _yarn(cfg: ModelConfig, dim: int, device=None) -> torch.Tensor:
    base, factor = cfg.rope_theta, cfg.rope_factor

    def correction_dim(rotations):
        return (dim * math.log(cfg.rope_original_max_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.rope_beta_fast or 32), correction_dim(cfg.rope_beta_slow or 1)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp.to(device=device, dtype=torch.float)
    return interpolation * (1 - keep) + extrapolation * keep


def inv_freq(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim / 2,), attention factor) for every rope type but dynamic's long positions."""
    dim = cfg.head_dim
    if cfg.rope_type == "yarn":
        return _yarn(cfg, dim, device), yarn_attention_factor(cfg)
    freqs = _default_inv_freq(cfg.rope_theta, dim, device)
    if cfg.rope_type == "linear":
        freqs = freqs / cfg.rope_factor
    elif cfg.rope_type == "llama3":
        freqs = _llama3(cfg, freqs)
    return freqs, 1.0


def _dynamic_rows(cfg: ModelConfig, positions: torch.Tensor) -> torch.Tensor:
    """(len(positions), head_dim / 2) angles of positions beyond the original context, each with the NTK base
    transformers computes for a sequence of position + 1 tokens."""
    dim, factor, orig = cfg.head_dim, cfg.rope_factor, cfg.rope_original_max_len
    p = positions.to(torch.float64)
    base = cfg.rope_theta * ((factor * (p + 1) / orig) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
    inv = 1.0 / (base.float()[:, None] ** exponents[None, :])
    return inv * p.float()[:, None]


def rope_tables(cfg: ModelConfig, max_len: int | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (max_len, head_dim), fp32, attention factor applied; ``max_len`` defaults to cfg.max_seq_len."""
    max_len = cfg.max_seq_len if max_len is None else max_len
    freqs, attention_factor = inv_freq(cfg, device)
    pos = torch.arange(max_len, dtype=torch.float32, device=device)
    angles = torch.outer(pos, freqs)
    if cfg.rope_type == "dynamic" and max_len > cfg.rope_original_max_len:
        long = torch.arange(cfg.rope_original_max_len, max_len, device=device)
        angles[cfg.rope_original_max_len:] = _dynamic_rows(cfg, long)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def rope_halves(cfg):
    """The rotary tables GroupQueryAttention takes (and the native decoder): cos, sin (max_seq_len, head_dim / 2)."""
    cos, sin = rope_tables(cfg)
    half = cfg.head_dim // 2
    return cos[:, :half], sin[:, :half]
