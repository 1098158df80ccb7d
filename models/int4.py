"""int4 weight storage: two 4-bit values per byte, per-group scales and integer zero points.

A weight W (out, in) is cut into groups of ``group_size`` consecutive input features.
Each group g of row o has a float32 scale s[o, g] and an integer zero point z[o, g]
in [0, 15]; the stored 4-bit values q in [0, 15] stand for

    W[o, i] ~= (q[o, i] - z[o, i // group_size]) * s[o, i // group_size]

Symmetric quantization is the case z = 8 everywhere (q - 8 in [-8, 7]); asymmetric
quantization fits z to each group's range (see :func:`rtn_params`).

Float zero points (``float_zero``, asymmetric only): z is a float32 per group instead of an
integer, as torchao's and ONNX Runtime's HQQ and llama.cpp's Q4_1 keep it (a Q4_1 block
d * k + m is the grid s = d, z = -m / d). Kernels that take integer zero points only
(``MatMulNBits``, ``DequantizeLinear``) run with z_int = round(z) and add the rest as a
per-group term: W = (q - z_int) * s + (z_int - z) * s (:func:`split_float_zero`).

The byte layout is ONNX Runtime's ``MatMulNBits`` layout, so an export writes these bytes
unchanged: ``packed[o, j]`` holds q[o, 2j] in its low nibble and q[o, 2j + 1] in its high
nibble, and each group occupies group_size / 2 consecutive bytes of its row. Zero points
are kept unpacked (one uint8 per group) in the model dir; :func:`pack_zero_points` packs
them two per byte for ``MatMulNBits``.
"""

from __future__ import annotations

import torch

from prunus.artifacts.errors import PrunusError

INT4_SCHEME = "int4-weight-only"
GROUP_SIZES = (128, 64, 32)
QMAX = 15
SYMMETRIC_ZERO = 8
_EPS = 1e-12


def default_group_size(in_features: int) -> int | None:
    """The largest of 128, 64, 32 that divides ``in_features`` (None when none does)."""
    return next((g for g in GROUP_SIZES if in_features % g == 0), None)


def check_group_size(group_size, in_features: int, where: str) -> int:
    """``group_size`` (None: the default for this width) checked against ``in_features``; returns it."""
    if group_size is None:
        g = default_group_size(in_features)
        if g is None:
            raise PrunusError(f"{where}: in_features {in_features} is not a multiple of 32; int4 needs groups of "
                              f"32, 64 or 128 (keep this layer out with exclude, or quantize it to int8)")
        return g
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise PrunusError(f"{where}: int4 group_size {group_size!r} must be one of 32, 64, 128")
    if in_features % group_size:
        raise PrunusError(f"{where}: group_size {group_size} does not divide in_features {in_features}; "
                          f"choose {default_group_size(in_features) or 'another scheme'} for this layer or exclude it")
    return group_size


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values in [0, 15], shape (out, in) with in even -> uint8 (out, in // 2), low nibble first."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: uint8 (out, in // 2) -> uint8 (out, in) in [0, 15]."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def pack_zero_points(zeros: torch.Tensor) -> torch.Tensor:
    """Zero points (out, n_groups) in [0, 15] -> uint8 (out * ceil(n_groups / 2),), MatMulNBits's layout
    (each row padded to whole bytes, even group in the low nibble)."""
    if zeros.shape[1] % 2:
        zeros = torch.cat([zeros, torch.full_like(zeros[:, :1], SYMMETRIC_ZERO)], dim=1)
    return pack_int4(zeros).reshape(-1)


def expand_groups(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """(out, n_groups) -> (out, n_groups * group_size), each group's value repeated over its columns."""
    return t.repeat_interleave(group_size, dim=1)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """Unpacked values (out, in), scales and zero points (out, n_groups) -> float32 weight (out, in)."""
    return (q.float() - expand_groups(zero.float(), group_size)) * expand_groups(scale.float(), group_size)


def round_half_up(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, exact halves up, as ONNX Runtime's blockwise quantizer (``roundf``, on the
    non-negative values that survive the clamp to [0, 15]) does; torch.round sends halves to even. Halves are
    common here: weights dequantized from a GGUF lie on a grid. (floor(x + 0.5) would be wrong just below 0.5.)"""
    r = torch.round(x)
    return r + ((x - r) == 0.5).to(r.dtype)


def rtn_params(w: torch.Tensor, group_size: int, symmetric: bool,
               float_zero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero point), each (out, n_groups), covering each group's range.

    Symmetric: z = 8 and s = e / -8, e the group's value of largest magnitude with its sign, so e lands
    on the grid's longer end (q = 0, q - 8 = -8) whichever its sign: a negative scale when e is positive,
    as llama.cpp's Q4_0 and ONNX Runtime's symmetric blocks store it. Its step |e| / 8 is finer than the
    positive-only max(-min / 8, max / 7) by 8/7 wherever e > 0 (on SmolLM2-135M's w1 of block 5, group
    64: 15% less squared error, the same as ONNX Runtime's ``quantize_matmul_4bits``).
    Asymmetric: s = (max - min) / 15 over a range that includes 0, z = round(-min / s). With ``float_zero``
    the range is the group's own (min and max, 0 need not lie on the grid) and z = -min / s, a float:
    Q4_1's grid, on which min and max are exact."""
    out_f, in_f = w.shape
    g = w.detach().float().reshape(out_f, in_f // group_size, group_size)
    if symmetric:
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        scale = torch.where(-lo >= hi, lo, hi) / -SYMMETRIC_ZERO
        scale = torch.where(scale.abs() < _EPS, torch.full_like(scale, _EPS), scale)  # an all-zero group
        zero = torch.full_like(scale, SYMMETRIC_ZERO, dtype=torch.uint8)
        return scale, zero
    if float_zero:
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        # a (nearly) constant group: step |min|, zero -+1, so q = 0 stands for min exactly (a step of
        # span / 15 there would put z at -min / step, too large for float32 to round q correctly)
        flat = hi - lo <= 1e-4 * torch.maximum(lo.abs(), hi.abs()).clamp(min=_EPS)
        scale = torch.where(flat, lo.abs().clamp(min=_EPS), (hi - lo) / QMAX)
        return scale, -lo / scale
    lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
    scale = ((hi - lo) / QMAX).clamp(min=_EPS)
    zero = round_half_up((-lo / scale).clamp(0, QMAX)).to(torch.uint8)
    return scale, zero


def quantize_int4(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """Round ``w`` (out, in) onto the grid of (scale, zero): uint8 values in [0, 15], unpacked. As ONNX Runtime's
    ``quantize_matmul_4bits``: w times the reciprocal scale, plus z, halves up (the same integers, bit for bit)."""
    q = w.detach().float() * expand_groups(1 / scale.float(), group_size) + expand_groups(zero.float(), group_size)
    return round_half_up(q).clamp(0, QMAX).to(torch.uint8)


def rtn_int4(w: torch.Tensor, group_size: int, symmetric: bool,
             float_zero: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest: (unpacked values, scale, zero point)."""
    scale, zero = rtn_params(w, group_size, symmetric, float_zero)
    return quantize_int4(w, scale, zero, group_size), scale, zero


def split_float_zero(zero: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float zero points (out, n_groups) -> (integer zero points uint8 in [0, 15], the per-group term
    (z_int - z) * s, float32): (q - z) * s == (q - z_int) * s + term, for kernels that take integers only."""
    z = zero.float()
    z_int = round_half_up(z).clamp(0, QMAX)
    return z_int.to(torch.uint8), ((z_int - z) * scale.float()).contiguous()


__all__ = ["INT4_SCHEME", "GROUP_SIZES", "default_group_size", "check_group_size", "pack_int4", "unpack_int4",
           "pack_zero_points", "dequantize_int4", "rtn_params", "quantize_int4", "rtn_int4", "expand_groups",
           "split_float_zero", "round_half_up"]
