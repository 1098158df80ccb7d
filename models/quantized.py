"""QuantizedLinear: int8 / float8 weights stored as plain tensors plus float32 scales, and the handlers of
the five schemes it stores (one class each; :mod:`prunus.models.quant_registry` lists them with int4's):

* ``int8-weight-only``: int8 weights, per-tensor, per-channel or per-group scales;
  the forward pass converts them to the activation dtype and multiplies (the scale is
  applied to the output when it is per channel, so the weight is never rescaled).
* ``w8a8-dynamic``: int8 weights and int8 activations with one scale per token,
  computed on the fly; int8 x int8 -> int32 products.
* ``w8a8-static``: the same with one calibrated activation scale (``input_scale``).
* ``fp8-weight-only``: float8 e4m3 weights with per-tensor or per-channel scales.
* ``fp8-w8a8``: float8 e4m3 weights and activations (dynamic per-token scales).

Integer products run on ``torch._int_mm`` on CUDA (where cuBLAS takes the shapes);
on CPU they are computed exactly on the int8 values in float32 (``_int_mm`` is exact
there too but far slower than the float32 matmul at these sizes). The float32 sums are
exact while in_features * 127^2 < 2^24 (in_features <= 1040); beyond that each sum is
rounded to float32 (relative 6e-8), far below the quantization error itself. float8
products run on ``torch._scaled_mm`` on GPUs with compute capability >= 8.9; elsewhere
the float8 values are upcast and multiplied, which gives the same numbers up to the
float32 summation order.

The buffers are the storage format: ``weight`` (out, in) int8 or float8_e4m3fn,
``weight_scale`` float32 (out, 1) per channel, (out, in // group_size) per group or
(1, 1) per tensor, for static schemes ``input_scale`` (a float32 scalar), and for a layer
with a bias (q/k/v and o projections of some families) ``bias`` (out,) float32, kept as it
was and added after the product. Tensor
parallelism shards them by slicing ``weight`` and ``weight_scale`` along out or in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prunus.artifacts.errors import PrunusError
from .schemes import GRANULARITIES, SCHEMES

INT8_MAX = 127.0
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_EPS = 1e-12


class EightBitQuantHandler:
    """The schemes stored as one int8 or float8 value per weight plus float32 scales, in a :class:`QuantizedLinear`.

    One subclass per scheme says what differs (storage dtype, whether activations are quantized, whether
    their scale is calibrated, which granularities apply); see :mod:`prunus.models.quant_registry` for what
    a handler offers. Handlers hold no state: one instance per scheme, in :data:`EIGHT_BIT`."""

    scheme: str
    storage: torch.dtype = torch.int8  # the stored weight's dtype
    weight_only: bool = True  # False: activations are quantized too, one scale per token or ``static``
    static: bool = False  # one calibrated activation scale per module (``input_scale``)
    granularities: tuple[str, ...] = ("per_tensor", "per_channel")

    @property
    def module_class(self) -> type[nn.Module]:
        return QuantizedLinear

    @property
    def qmax(self) -> float:
        return FP8_MAX if self.storage == torch.float8_e4m3fn else INT8_MAX

    def check(self, granularity: str, group_size: int | None, in_features: int | None = None,
              where: str = "quantize") -> None:
        """Raise a PrunusError naming what is wrong with this granularity and group size for this scheme."""
        if granularity not in GRANULARITIES:
            raise PrunusError(f"{where}: unknown granularity {granularity!r}; choose one of: {', '.join(GRANULARITIES)}")
        if granularity not in self.granularities:
            owners = [h.scheme for h in EIGHT_BIT.values() if granularity in h.granularities]
            raise PrunusError(f"{where}: {granularity} scales are for {', '.join(owners)}; use "
                              f"{' or '.join(reversed(self.granularities))} with {self.scheme}")
        if granularity == "per_group":
            if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
                raise PrunusError(f"{where}: per_group needs group_size, a positive integer (e.g. 32)")
            if in_features is not None and in_features % group_size:
                raise PrunusError(f"{where}: group_size {group_size} does not divide in_features {in_features}; choose a divisor")
        elif group_size is not None:
            raise PrunusError(f"{where}: group_size is only used with granularity per_group; drop it or set per_group")

    def round(self, scaled: torch.Tensor) -> torch.Tensor:
        """Values already divided by their scale -> the stored dtype (int8 rounds; float8 rounds as it casts)."""
        if self.storage == torch.float8_e4m3fn:
            return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)

    def quantize_weight(self, w: torch.Tensor, granularity: str = "per_channel",
                        group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """float weight (out, in) -> (stored values, float32 scale) with symmetric absmax scales."""
        out_f, in_f = w.shape
        w = w.detach().float()
        if granularity == "per_tensor":
            amax = w.abs().amax().reshape(1, 1)
        elif granularity == "per_channel":
            amax = w.abs().amax(dim=1, keepdim=True)
        else:
            amax = w.abs().reshape(out_f, in_f // group_size, group_size).amax(dim=2)
        scale = amax.clamp(min=_EPS) / self.qmax
        return self.round(w / _expand(scale, in_f)), scale.float()

    def quantize_activation(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., in) float -> (quantized values kept in float32, float32 scale (..., 1) or scalar).

        Without ``scale`` each token gets its own absmax scale (dynamic schemes)."""
        x = x.float()
        if scale is None:
            scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=_EPS) / self.qmax
        return self.round(x / scale).float(), scale

    def quantize(self, linear: nn.Linear, granularity: str = "per_channel", group_size: int | None = None,
                 input_scale: float | torch.Tensor | None = None) -> "QuantizedLinear":
        """``linear`` as a QuantizedLinear of this scheme (``input_scale``: the calibrated one, static schemes)."""
        return QuantizedLinear.from_linear(linear, self.scheme, granularity, group_size, input_scale=input_scale)

    def build(self, linear: nn.Module, spec: dict, where: str) -> "QuantizedLinear":
        """The empty module that ``linear``'s stored tensors load into, as config.json's ``spec`` describes it."""
        return QuantizedLinear(linear.in_features, linear.out_features, self.scheme, spec.get("granularity", "per_channel"),
                               spec.get("group_size"), device=linear.weight.device, bias=linear.bias is not None,
                               where=where)

    def spec(self, module: "QuantizedLinear") -> dict:
        """What config.json records for ``module``."""
        return {"scheme": self.scheme, "granularity": module.granularity, "group_size": module.group_size}


class WeightOnlyInt8QuantHandler(EightBitQuantHandler):
    scheme = "int8-weight-only"
    granularities = ("per_tensor", "per_channel", "per_group")


class W8A8DynamicQuantHandler(EightBitQuantHandler):
    scheme, weight_only = "w8a8-dynamic", False


class W8A8StaticQuantHandler(EightBitQuantHandler):
    scheme, weight_only, static = "w8a8-static", False, True


class WeightOnlyFp8QuantHandler(EightBitQuantHandler):
    scheme, storage = "fp8-weight-only", torch.float8_e4m3fn


class Fp8W8A8QuantHandler(EightBitQuantHandler):
    scheme, storage, weight_only = "fp8-w8a8", torch.float8_e4m3fn, False


EIGHT_BIT: dict[str, EightBitQuantHandler] = {h.scheme: h() for h in (
    WeightOnlyInt8QuantHandler, W8A8DynamicQuantHandler, W8A8StaticQuantHandler, WeightOnlyFp8QuantHandler,
    Fp8W8A8QuantHandler)}


def eight_bit_handler(scheme: str, where: str = "quantize") -> EightBitQuantHandler:
    """The handler of an int8 / float8 ``scheme``, or a PrunusError naming it."""
    if scheme in EIGHT_BIT:
        return EIGHT_BIT[scheme]
    if scheme in SCHEMES:
        raise PrunusError(f"{where}: {scheme} is not stored as a QuantizedLinear; quantize with the quantize pass's "
                          f"scheme {scheme} (prunus.models.quant_registry builds its module)")
    raise PrunusError(f"{where}: unknown scheme {scheme!r}; choose one of: {', '.join(SCHEMES)}")


def check_scheme(scheme: str, granularity: str, group_size: int | None, in_features: int | None = None,
                 where: str = "quantize") -> None:
    """Raise a PrunusError naming what is wrong with this combination."""
    eight_bit_handler(scheme, where).check(granularity, group_size, in_features, where)


def scale_shape(out_features: int, in_features: int, granularity: str, group_size: int | None) -> tuple[int, int]:
    if granularity == "per_tensor":
        return (1, 1)
    if granularity == "per_channel":
        return (out_features, 1)
    return (out_features, in_features // group_size)


def _expand(scale: torch.Tensor, in_features: int) -> torch.Tensor:
    """A (out, n_groups) scale repeated to (out, in); (out, 1) and (1, 1) broadcast already."""
    if scale.shape[1] in (1, in_features):
        return scale
    return scale.repeat_interleave(in_features // scale.shape[1], dim=1)


def _int_mm_fits(x2d: torch.Tensor, w: torch.Tensor) -> bool:
    return x2d.is_cuda and x2d.shape[0] > 16 and x2d.shape[1] % 8 == 0 and w.shape[0] % 8 == 0


def _scaled_mm_fits(x2d: torch.Tensor, w: torch.Tensor) -> bool:
    return (x2d.is_cuda and torch.cuda.get_device_capability(x2d.device) >= (8, 9)
            and x2d.shape[0] % 16 == 0 and x2d.shape[1] % 16 == 0 and w.shape[0] % 16 == 0)


def convert_keeping_dtypes(module: nn.Module, fn) -> nn.Module:
    """Apply a module conversion ``fn`` to ``module``'s buffers, moving them but keeping each one's dtype.

    Why: ``model.to(torch.bfloat16)``, ``.half()`` and ``.to(device)`` reach a child module only
    through the private ``nn.Module._apply(fn)`` (torch 1.x through 2.13: ``Module.to`` builds one
    ``convert`` function and ``_apply`` walks the children with it); there is no public per-module
    conversion hook. That conversion casts every floating-point tensor, so a float8_e4m3fn weight
    or a float32 scale would silently become bfloat16 (int8 weights are left alone by torch).
    A quantized module's buffers are its storage format, so its ``_apply`` calls this function,
    the one place prunus steps around that private method: the device changes, the dtype stays.
    """
    for name, buf in module._buffers.items():
        if buf is not None:
            moved = fn(buf)
            module._buffers[name] = moved if moved.dtype == buf.dtype else buf.to(moved.device)
    return module


class QuantizedLinear(nn.Module):
    """A Linear whose weight is stored as int8 / float8 values (its bias, if any, stays float32); see the module
    docstring. ``handler`` is its scheme's :class:`EightBitQuantHandler`."""

    def __init__(self, in_features: int, out_features: int, scheme: str, granularity: str = "per_channel",
                 group_size: int | None = None, device=None, bias: bool = False, where: str = "quantize"):
        super().__init__()
        self.handler = eight_bit_handler(scheme, where)
        self.handler.check(granularity, group_size, in_features, where)
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.granularity, self.group_size = scheme, granularity, group_size
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=self.handler.storage, device=device))
        shape = scale_shape(out_features, in_features, granularity, group_size)
        self.register_buffer("weight_scale", torch.ones(shape, dtype=torch.float32, device=device))
        if self.handler.static:
            self.register_buffer("input_scale", torch.ones((), dtype=torch.float32, device=device))
        else:
            self.input_scale = None
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32, device=device))
        else:
            self.bias = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str, granularity: str = "per_channel", group_size: int | None = None,
                    input_scale: float | torch.Tensor | None = None) -> "QuantizedLinear":
        q = cls(linear.in_features, linear.out_features, scheme, granularity, group_size, device=linear.weight.device,
                bias=linear.bias is not None)
        q.weight, q.weight_scale = q.handler.quantize_weight(linear.weight, granularity, group_size)
        if linear.bias is not None:
            q.bias = linear.bias.detach().float().clone()
        if q.handler.static:
            if input_scale is None:
                raise PrunusError(f"quantize: {scheme} needs a calibrated input_scale")
            q.input_scale = torch.as_tensor(input_scale, dtype=torch.float32, device=q.weight.device).reshape(())
        return q

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (out, in) these values and scales stand for."""
        return self.weight.float() * _expand(self.weight_scale, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.handler.weight_only:
            if self.granularity == "per_group":
                return F.linear(x, self.dequantize().to(x.dtype))
            return F.linear(x, self.weight.to(x.dtype)) * self.weight_scale.t().to(x.dtype)
        shape = x.shape
        x2d = x.reshape(-1, self.in_features)
        xq, xs = self.handler.quantize_activation(x2d, self.input_scale)
        if self.handler.storage == torch.float8_e4m3fn:
            if _scaled_mm_fits(x2d, self.weight):
                y = torch._scaled_mm(xq.to(torch.float8_e4m3fn), self.weight.t(), scale_a=xs.float(),
                                     scale_b=self.weight_scale.t().expand(1, self.out_features).contiguous(),
                                     out_dtype=torch.bfloat16).float()
            else:
                y = F.linear(xq, self.weight.float()) * xs * self.weight_scale.t()
        elif _int_mm_fits(x2d, self.weight):
            y = torch._int_mm(xq.to(torch.int8), self.weight.t()).float() * xs * self.weight_scale.t()
        else:
            y = F.linear(xq, self.weight.float()) * xs * self.weight_scale.t()
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _apply(self, fn, recurse=True):
        return convert_keeping_dtypes(self, fn)

    def spec(self) -> dict:
        """What config.json records for this module (its handler decides)."""
        return self.handler.spec(self)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}, granularity={self.granularity}{group}"


__all__ = ["EIGHT_BIT", "EightBitQuantHandler", "Fp8W8A8QuantHandler", "QuantizedLinear", "W8A8DynamicQuantHandler",
           "W8A8StaticQuantHandler", "WeightOnlyFp8QuantHandler", "WeightOnlyInt8QuantHandler", "check_scheme",
           "eight_bit_handler", "convert_keeping_dtypes"]
