"""Int4Linear: a Linear whose weight is stored as packed int4 with per-group scales and zero points.

Buffers (the storage format, see :mod:`prunus.models.int4`): ``weight`` uint8 (out, in // 2),
two 4-bit values per byte; ``weight_scale`` float32 (out, in // group_size); ``weight_zero``
uint8 (out, in // group_size), values in [0, 15] (8 everywhere when symmetric), or float32 with
``float_zero`` (any value; see :mod:`prunus.models.int4`); ``bias`` (out,) float32 when the layer
has one.

Forward pass:

* CUDA (bfloat16 activations, shapes tinygemm takes): ``torch._weight_int4pack_mm``, on a
  copy of the weight repacked once by ``torch._convert_weight_to_int4pack`` with bfloat16
  scales and tinygemm's zeros ((q - 8) * s + (8 - z) * s). Its output is bfloat16.
* elsewhere, CPU included: the weight is dequantized and multiplied in the activation dtype.
  torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) ran several times slower than an
  fp32 matmul on SmolLM2 shapes on our CPUs, so it is not used; ONNX Runtime's ``MatMulNBits``
  is the CPU speed path (prunus export).

It offers what every stored quantized module does (:class:`prunus.models.quant_registry.QuantizedModule`:
``scheme``, ``weight``, ``weight_scale``, ``bias``, ``dequantize()``, ``spec()``), so every stage that handles
stored quantized layers (export, dequantized copies, GGUF writing, reports) finds it through the registry;
:class:`WeightOnlyInt4QuantHandler` is its scheme's handler there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .int4 import INT4_SCHEME, check_group_size, dequantize_int4, pack_int4, rtn_int4, unpack_int4
from .quantized import convert_keeping_dtypes


def tinygemm_available(x: torch.Tensor, module: "Int4Linear") -> bool:
    """Whether ``torch._weight_int4pack_mm`` takes this input: CUDA, bfloat16, N % 8 == 0, K % 32 == 0."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_weight_int4pack_mm")
            and module.out_features % 8 == 0 and _inner_k_tiles(module.in_features) is not None
            and module.group_size in (32, 64, 128, 256))


def _inner_k_tiles(k: int) -> int | None:
    return next((t for t in (8, 4, 2) if k % (t * 16) == 0), None)


class Int4Linear(nn.Module):
    """Packed int4 weights; see the module docstring."""

    def __init__(self, in_features: int, out_features: int, group_size: int | None = None, symmetric: bool = True,
                 algorithm: str = "rtn", device=None, bias: bool = False, where: str = "int4", float_zero: bool = False):
        super().__init__()
        group_size = check_group_size(group_size, in_features, where)
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.granularity, self.group_size = INT4_SCHEME, "per_group", group_size
        self.symmetric, self.algorithm, self.float_zero = bool(symmetric), algorithm, bool(float_zero)
        n_groups = in_features // group_size
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, n_groups, dtype=torch.float32, device=device))
        self.register_buffer("weight_zero", torch.full((out_features, n_groups), 8, device=device,
                                                       dtype=torch.float32 if float_zero else torch.uint8))
        self.input_scale = None
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32, device=device))
        else:
            self.bias = None
        self._tinygemm = None  # (key, packed weight, scales_and_zeros) built on the first CUDA forward

    @classmethod
    def from_quantized(cls, linear: nn.Linear, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                       group_size: int, symmetric: bool, algorithm: str, float_zero: bool = False) -> "Int4Linear":
        """A module holding unpacked values ``q`` (out, in) in [0, 15] with their scales and zero points."""
        m = cls(linear.in_features, linear.out_features, group_size, symmetric, algorithm,
                device=linear.weight.device, bias=linear.bias is not None, float_zero=float_zero)
        m.weight = pack_int4(q)
        m.weight_scale = scale.detach().float().contiguous()
        m.weight_zero = zero.to(m.weight_zero.dtype).contiguous()
        if linear.bias is not None:
            m.bias = linear.bias.detach().float().clone()
        return m

    def unpacked(self) -> torch.Tensor:
        """The 4-bit values (out, in), uint8 in [0, 15]."""
        return unpack_int4(self.weight)

    def dequantize(self) -> torch.Tensor:
        return dequantize_int4(self.unpacked(), self.weight_scale, self.weight_zero, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _apply(self, fn, recurse=True):
        return convert_keeping_dtypes(self, fn)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if tinygemm_available(x, self):
            shape = x.shape
            w, sz = self._tinygemm_weight()
            y = torch._weight_int4pack_mm(x.reshape(-1, self.in_features).contiguous(), w, self.group_size, sz)
            return y.reshape(*shape[:-1], self.out_features)
        return F.linear(x, self.dequantize().to(x.dtype))

    def _tinygemm_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight in tinygemm's layout (even column in the high nibble, then
        ``_convert_weight_to_int4pack``) and its (n_groups, out, 2) bfloat16 scales and zeros; cached."""
        key = (self.weight.data_ptr(), self.weight_scale.data_ptr(), self.weight_zero.data_ptr(), self.weight.device)
        if self._tinygemm is None or self._tinygemm[0] != key:
            q = self.unpacked()
            w = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
            packed = torch._convert_weight_to_int4pack(w, _inner_k_tiles(self.in_features))
            scale = self.weight_scale.float()
            zero = (8 - self.weight_zero.float()) * scale
            sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
            self._tinygemm = (key, packed, sz)
        return self._tinygemm[1], self._tinygemm[2]

    def spec(self) -> dict:
        """What config.json records for this module (its handler decides)."""
        return WeightOnlyInt4QuantHandler().spec(self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}, "
                f"group_size={self.group_size}, symmetric={self.symmetric}, algorithm={self.algorithm}"
                + (", float_zero=True" if self.float_zero else ""))


class WeightOnlyInt4QuantHandler:
    """The ``int4-weight-only`` scheme: packed int4 in an :class:`Int4Linear` (see
    :mod:`prunus.models.quant_registry` for what a handler offers). The calibrated algorithms (GPTQ, AWQ, HQQ)
    live in the compress pass; they hand their codes to :meth:`from_codes`."""

    scheme = INT4_SCHEME
    weight_only = True
    module_class = Int4Linear

    def quantize(self, linear: nn.Linear, group_size: int | None = None, symmetric: bool = True,
                 float_zero: bool = False, where: str = "quantize") -> Int4Linear:
        """``linear`` rounded to nearest on each group's range."""
        group_size = check_group_size(group_size, linear.in_features, where)
        codes = rtn_int4(linear.weight, group_size, symmetric, float_zero)
        return self.from_codes(linear, *codes, group_size, symmetric, "rtn", float_zero=float_zero)

    def from_codes(self, linear: nn.Linear, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   group_size: int, symmetric: bool, algorithm: str, float_zero: bool = False) -> Int4Linear:
        """``linear`` holding unpacked values ``q`` (out, in) in [0, 15] with their scales and zero points."""
        return Int4Linear.from_quantized(linear, q, scale, zero, group_size, symmetric, algorithm, float_zero=float_zero)

    def build(self, linear: nn.Module, spec: dict, where: str) -> Int4Linear:
        """The empty module that ``linear``'s stored tensors load into, as config.json's ``spec`` describes it."""
        return Int4Linear(linear.in_features, linear.out_features, spec.get("group_size"), spec.get("symmetric", True),
                          spec.get("algorithm", "rtn"), device=linear.weight.device, bias=linear.bias is not None,
                          where=where, float_zero=spec.get("float_zero") is True)

    def spec(self, module: Int4Linear) -> dict:
        """What config.json records for ``module``."""
        spec = {"scheme": self.scheme, "granularity": "per_group", "group_size": module.group_size,
                "symmetric": module.symmetric, "algorithm": module.algorithm}
        return {**spec, "float_zero": True} if module.float_zero else spec


__all__ = ["Int4Linear", "WeightOnlyInt4QuantHandler", "tinygemm_available"]
