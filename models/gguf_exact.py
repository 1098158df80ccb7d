"""Which GGUF type holds a model dir's stored integer weights exactly, and those weights as its blocks.

A GGUF block of 32 values carries fp16 numbers: Q8_0 ``w = q d`` (q int8), Q4_0 ``w = (q - 8) d`` and Q4_1
``w = q d + m`` (q in 0..15). prunus stores int8 weights as int8 codes with float32 scales (per channel, or per
group of a multiple of 32), and int4 weights as 4-bit codes with float32 scales and zero points per group
(:mod:`prunus.models.quantized_int4`): ``w = (q - z) s``. Such a tensor goes into blocks as it is when every number
the blocks need is an fp16 value: ``d = s`` (and for Q4_1 ``m = -z s``); the products are then exact in float32, so
llama.cpp reads the very weights prunus runs. Q4_0 needs ``z = 8`` everywhere, else Q4_1 holds the tensor.
Where no block type holds it (a scale that is not an fp16 value), :func:`exact_blocks` says so and the writer keeps
the tensor in F32, the dequantized values exactly (:mod:`prunus.models.gguf_write`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32


@dataclass(frozen=True)
class Codes:
    """A stored tensor as per-block numbers: codes (out, in), scales and zero points (out, in // 32)."""

    bits: int
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None  # int4 only (float32)

    def rows(self, fn) -> "Codes":
        """The same tensor with ``fn`` applied to the rows of each part (llama.cpp's rotary order)."""
        return Codes(self.bits, fn(self.q), fn(self.scale), None if self.zero is None else fn(self.zero))


def _per_block(t: torch.Tensor, in_features: int) -> torch.Tensor | None:
    """A (out, groups) float tensor as (out, in // 32), or None where a group does not split into blocks of 32."""
    groups = t.shape[1]
    if in_features % BLOCK or (in_features // groups) % BLOCK:
        return None
    return t.float().repeat_interleave(in_features // groups // BLOCK, dim=1)


def stored_codes(model) -> dict[str, Codes]:
    """{prunus weight name: Codes} of the stored int8 and int4 layers whose groups split into blocks of 32."""
    from .quantized import QuantizedLinear
    from .quantized_int4 import Int4Linear

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):
            scale, zero = _per_block(m.weight_scale, m.in_features), _per_block(m.weight_zero, m.in_features)
            if scale is not None:
                out[f"{name}.weight"] = Codes(4, m.unpacked(), scale, zero)
        elif isinstance(m, QuantizedLinear) and m.weight.dtype == torch.int8:
            s = m.weight_scale.expand(m.out_features, -1) if m.weight_scale.shape[0] == 1 else m.weight_scale
            scale = _per_block(s, m.in_features)
            if scale is not None:
                out[f"{name}.weight"] = Codes(8, m.weight, scale, None)
    return out


def _fp16_exact(t: torch.Tensor) -> bool:
    half = t.half()
    return bool(torch.isfinite(half).all()) and torch.equal(half.float(), t.float())


def _half_bytes(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy().astype(np.float16)[..., None].view(np.uint8)


def exact_blocks(codes: Codes):
    """(GGML type name, uint8 rows (out, in // 32 * block bytes)) holding ``codes`` exactly, or None."""
    rows, blocks = codes.scale.shape
    if not _fp16_exact(codes.scale):
        return None
    if codes.bits == 8:
        values = codes.q.to(torch.int8).reshape(rows, blocks, BLOCK).numpy().view(np.uint8)
        return "Q8_0", np.concatenate([_half_bytes(codes.scale), values], axis=-1).reshape(rows, -1)
    nibbles = codes.q.to(torch.uint8).reshape(rows, blocks, 2, BLOCK // 2)
    packed = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).numpy()
    if bool((codes.zero == 8).all()):
        return "Q4_0", np.concatenate([_half_bytes(codes.scale), packed], axis=-1).reshape(rows, -1)
    offset = -codes.zero.float() * codes.scale
    if not _fp16_exact(offset):
        return None
    parts = [_half_bytes(codes.scale), _half_bytes(offset), packed]
    return "Q4_1", np.concatenate(parts, axis=-1).reshape(rows, -1)
