"""Scales a GGUF block holds exactly: the ``gguf_scales`` option of the int8 and int4 quantize passes.

GGUF's Q8_0, Q4_0 and Q4_1 blocks carry half-precision numbers (``d``, and Q4_1's ``m``). prunus stores float32
scales, so a stored tensor goes into those blocks as it is only where every number the blocks need is a half
value (:mod:`prunus.models.gguf_exact`); elsewhere ``prunus convert --to-gguf`` keeps the tensor in F32, exact but
four to eight times the size. With ``gguf_scales: true`` the pass rounds each scale once its codes are fitted:

* int8 (Q8_0, ``w = q d``) and symmetric int4 (Q4_0, ``w = (q - 8) d``): to the nearest half value;
* int4 with zero points (Q4_1, ``w = q d + m``, ``m = -z s``): to 7 significant bits and a multiple of 2^-24, so
  that ``z s`` for every integer z in 0..15 is a half value too.

The codes stay as fitted: a scale moves by at most 2^-12 (int8, symmetric int4) or 2^-8 (with zero points) of
itself, a small part of the rounding step the codes already carry. The model dir then holds the weights a GGUF
file of it holds, so llama.cpp and prunus run the same values.
"""

from __future__ import annotations

import torch

from prunus.artifacts.errors import PrunusError

HALF_TINY = 2.0 ** -24  # the smallest half (subnormal) step
_SEVEN_BITS_FLOOR = 2.0 ** -17  # below it, a multiple of 2^-24 has at most 7 significant bits


def half_scales(scale: torch.Tensor, zero_points: bool) -> torch.Tensor:
    """``scale`` (float32, any sign) rounded as the module docstring says, as float32."""
    s = scale.float()
    if not zero_points:
        return s.to(torch.float16).float()
    mantissa, exponent = torch.frexp(s)  # s = mantissa * 2^exponent, |mantissa| in [0.5, 1)
    seven = torch.ldexp(torch.round(mantissa * 128) / 128, exponent)
    tiny = torch.round(s / HALF_TINY) * HALF_TINY
    out = torch.where(s.abs() < _SEVEN_BITS_FLOOR, tiny, seven)
    return torch.where(out == 0, torch.full_like(out, HALF_TINY).copysign(s), out)


def round_module_scales(module) -> None:
    """Round a quantized Linear's ``weight_scale`` in place (int8: per tensor, channel or group; int4 with integer
    zero points). One line for a module whose blocks no GGUF type could hold."""
    from prunus.models.quantized_int4 import Int4Linear

    if isinstance(module, Int4Linear):
        if module.weight_zero.dtype.is_floating_point:
            raise PrunusError("quantize: gguf_scales needs integer zero points (Q4_1 holds z·s as a half); drop "
                              "float_zero")
        module.weight_scale.copy_(half_scales(module.weight_scale, zero_points=not module.symmetric))
        return
    if getattr(module, "weight", None) is None or module.weight.dtype != torch.int8:
        raise PrunusError(f"quantize: gguf_scales is for int8 and int4 weights (GGUF's Q8_0, Q4_0 and Q4_1), not "
                          f"{getattr(module.weight, 'dtype', type(module).__name__)}; drop it")
    module.weight_scale.copy_(half_scales(module.weight_scale, zero_points=False))


def round_scales(model, names) -> None:
    """:func:`round_module_scales` on each named submodule of ``model``."""
    with torch.no_grad():
        for name in names:
            round_module_scales(model.get_submodule(name))


__all__ = ["half_scales", "round_module_scales", "round_scales"]
