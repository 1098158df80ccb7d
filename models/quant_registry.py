"""The quantization schemes prunus stores: one handler per scheme, in one registry.

A handler (:class:`QuantHandler`) says, for its scheme,

* how to quantize one Linear (``quantize(linear, **options)``: absmax scales for int8 / float8, round to
  nearest for int4; the calibrated algorithms of :mod:`prunus.compress` build on it);
* how to build the quantized module that stored tensors load into (``build(linear, spec, where)``, from the
  record config.json holds for that module), which ``load_model`` calls before loading the weights;
* what config.json records for a module (``spec(module)``).

The handlers: :class:`~prunus.models.quantized.WeightOnlyInt8QuantHandler`, ``W8A8DynamicQuantHandler``,
``W8A8StaticQuantHandler``, ``WeightOnlyFp8QuantHandler``, ``Fp8W8A8QuantHandler`` (a ``QuantizedLinear``
each) and :class:`~prunus.models.quantized_int4.WeightOnlyInt4QuantHandler` (an ``Int4Linear``). A module
is quantized when its ``scheme`` names a handler whose ``module_class`` it is (:func:`is_quantized`); what
every such module offers is :class:`QuantizedModule`. The scheme names alone, for code that must not import
torch, are in :mod:`prunus.models.schemes`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short

from .quantized import EIGHT_BIT
from .quantized_int4 import WeightOnlyInt4QuantHandler
from .schemes import SCHEMES


class QuantizedModule(Protocol):
    """What every stored quantized Linear offers, whatever its scheme (export, tensor parallelism, LoRA,
    reports and GGUF writing read these)."""

    in_features: int
    out_features: int
    scheme: str
    weight: torch.Tensor  # the stored values (int8, float8_e4m3fn, or packed int4 as uint8)
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def dequantize(self) -> torch.Tensor: ...  # the float32 weight (out, in)

    def spec(self) -> dict: ...  # the config.json record


class QuantHandler(Protocol):
    """One scheme: how to quantize a Linear, how to build its module from a stored record, what it records."""

    scheme: str
    weight_only: bool  # activations stay in float (a base LoRA can train over)
    module_class: type[nn.Module]

    def quantize(self, linear: nn.Linear, **options) -> QuantizedModule: ...

    def build(self, linear: nn.Module, spec: dict, where: str) -> QuantizedModule: ...

    def spec(self, module: QuantizedModule) -> dict: ...


HANDLERS: dict[str, QuantHandler] = {**EIGHT_BIT, WeightOnlyInt4QuantHandler.scheme: WeightOnlyInt4QuantHandler()}


def handler(scheme, where: str = "quantize") -> QuantHandler:
    """The handler of ``scheme``, or one PrunusError line naming it and the known schemes."""
    if not isinstance(scheme, str) or scheme not in HANDLERS:
        raise PrunusError(f"{where}: unknown scheme {short(scheme)}; choose one of: {', '.join(SCHEMES)}")
    return HANDLERS[scheme]


def handler_of(module: nn.Module) -> QuantHandler | None:
    """The handler of a stored quantized module, None for any other module."""
    scheme = getattr(module, "scheme", None)
    h = HANDLERS.get(scheme) if isinstance(scheme, str) else None
    return h if h is not None and isinstance(module, h.module_class) else None


def is_quantized(module: nn.Module) -> bool:
    """Whether ``module`` stores its weight quantized (any registered scheme)."""
    return handler_of(module) is not None


def quantized_modules(model: nn.Module) -> dict[str, QuantizedModule]:
    """name -> module of every stored quantized module of ``model``, in module order."""
    return {name: m for name, m in model.named_modules() if is_quantized(m)}


def quantized_layout(model: nn.Module, modules: dict[str, dict]) -> None:
    """Swap the listed Linear modules of ``model`` for empty quantized ones, as each record of config.json's
    ``compression.quantization.modules`` describes it (before loading a state dict)."""
    for name, spec in modules.items():
        where = f"config.json: module {name}"
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            raise PrunusError(f"config.json: quantized module {name!r} is not in the model; re-create the model dir") from None
        model.set_submodule(name, handler(spec.get("scheme"), where).build(linear, spec, where))


def count_params(model: nn.Module) -> int:
    """Parameters plus quantized weights (which are buffers), so quantizing does not change the count."""
    extra = sum(m.out_features * m.in_features + (0 if m.bias is None else m.bias.numel())
                for m in quantized_modules(model).values())
    return sum(p.numel() for p in model.parameters()) + extra


__all__ = ["HANDLERS", "QuantHandler", "QuantizedModule", "count_params", "handler", "handler_of", "is_quantized",
           "quantized_layout", "quantized_modules"]
