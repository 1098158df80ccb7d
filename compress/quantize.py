"""The quantize pass: ``scheme`` picks its handler in :mod:`prunus.models.quant_registry` and the pass that
quantizes a model to it (:data:`SCHEME_PASSES`); each of those takes its own arguments, and one given to a
scheme that does not take it is refused naming the scheme it is for.

* int8 / float8 schemes (:func:`eight_bit_pass`): weights get symmetric absmax scales (per tensor, per output
  channel or per group of input channels). ``w8a8-static`` also calibrates one activation scale per module
  on calibration batches (``minmax`` or ``percentile``).
* ``int4-weight-only``: :func:`prunus.compress.int4.int4_pass` (rtn, gptq, awq, hqq; int8 mixed in).

The output head is excluded by default (``exclude`` not given); a model with tied embeddings whose head is quantized is untied
first (the embedding table stays in float), and the config records it. ``exclude`` takes module names,
parents and globs; ``layers.-K`` names the K-th block from the end, so a recipe can keep the last block in
float whatever the depth (the fp8 recipes do: on SmolLM2-135M the last block holds most of fp8's error).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from prunus.artifacts.errors import PrunusError
from prunus.models.compression_state import compression_state
from prunus.models.quant_registry import handler
from prunus.models.quantized import EightBitQuantHandler
from prunus.models.quantized_int4 import WeightOnlyInt4QuantHandler
from prunus.models.schemes import SCHEMES

from .calibrate import input_absmax
from .gguf_scales import round_scales
from .int4 import int4_pass
from .options import check_calibration
from .select import float_linears, given_exclude
from .untie_output import untie_output


def linear_names(model: nn.Module, exclude=()) -> tuple[list[str], list[str]]:
    """(names of the float Linear modules to quantize, names of those excluded); see ``select.py``."""
    chosen, skipped = float_linears(model, exclude, where="quantize")
    return list(chosen), skipped


def eight_bit_pass(model, ctx, *, scheme: str, granularity: str = "per_channel", group_size: int | None = None,
                   calibration: str = "minmax", percentile: float = 99.99, n_calib: int = 8,
                   exclude: str | list | tuple | None = None, gguf_scales: bool = False):
    """Replace every float Linear not in ``exclude`` by a QuantizedLinear of the int8 / float8 ``scheme``, in
    place; record the layout in the model's CompressionState (``quantization``). Returns ``model``.
    ``gguf_scales``: int8 scales rounded to half values, so GGUF's Q8_0 holds the weights exactly
    (:mod:`prunus.compress.gguf_scales`)."""
    scheme_handler = handler(scheme)
    scheme_handler.check(granularity, group_size)
    check_calibration(calibration, percentile)
    exclude = given_exclude(model, exclude, "quantize")
    names, skipped = linear_names(model, exclude)
    if not names:
        raise PrunusError(f"quantize: exclude={exclude} leaves no Linear module to quantize; exclude fewer")
    for name in names:
        scheme_handler.check(granularity, group_size, model.get_submodule(name).in_features, where=f"quantize {name}")
    state = compression_state(model)
    info = state.quantization or {"modules": {}, "excluded": []}
    if "output" in names and model.config.tie_embeddings:
        untie_output(model)
        info["untied_output"] = True
    input_scales = {}
    if scheme_handler.static:
        batches = ctx.calibration(n_calib)
        amax = input_absmax(model, names, batches, method=calibration, percentile=percentile)
        input_scales = {n: max(a, 1e-12) / scheme_handler.qmax for n, a in amax.items()}
        info["calibration"] = {"method": calibration, "n_batches": n_calib,
                               **({"percentile": percentile} if calibration == "percentile" else {})}
    with torch.no_grad():
        for name in names:
            q = scheme_handler.quantize(model.get_submodule(name), granularity, group_size,
                                        input_scale=input_scales.get(name))
            model.set_submodule(name, q)
            if gguf_scales:
                round_scales(model, [name])
            info["modules"][name] = scheme_handler.spec(q)
    if gguf_scales:
        info["gguf_scales"] = True
    info["excluded"] = sorted(set(info.get("excluded", [])) | set(skipped))
    state.quantization = info
    return model


# the pass that quantizes a model to the schemes of each kind of handler, given the scheme
SCHEME_PASSES = ((EightBitQuantHandler, lambda scheme: functools.partial(eight_bit_pass, scheme=scheme)),
                 (WeightOnlyInt4QuantHandler, lambda scheme: int4_pass))


def scheme_pass(scheme, where: str = "quantize"):
    """The pass that quantizes a model to ``scheme``, called as ``fn(model, ctx, **options)``; its signature
    lists the options the scheme takes (after model and ctx)."""
    scheme_handler = handler(scheme, where)
    return next(make(scheme) for kind, make in SCHEME_PASSES if isinstance(scheme_handler, kind))


def scheme_options(scheme) -> list[str]:
    """The options ``scheme``'s pass takes (``scheme`` aside)."""
    return [k for k in list(inspect.signature(scheme_pass(scheme)).parameters)[2:] if k != "scheme"]


def quantize_pass(model, ctx, *, scheme: str, **options):
    """Quantize ``model`` in place to ``scheme`` with that scheme's ``options``; returns it (see the module
    docstring). An option the scheme does not take is one PrunusError naming the scheme it is for."""
    fn = scheme_pass(scheme)
    takes = scheme_options(scheme)
    extra = [k for k in options if k not in takes]
    if extra:
        owners = [s for s in SCHEMES if set(extra) & set(scheme_options(s))]
        if owners:
            raise PrunusError(f"quantize: {', '.join(extra)}: arguments that are for scheme {', '.join(owners)}, "
                              f"not {scheme}; drop them")
        raise PrunusError(f"quantize: scheme {scheme} takes no {', '.join(extra)}; its arguments: {', '.join(takes)}")
    return fn(model, ctx, **options)


def _dispatch(args: dict):
    """The function that takes a recipe's quantize arguments besides ``scheme`` (None while the scheme is unknown)."""
    return scheme_pass(args["scheme"]) if args.get("scheme") in SCHEMES else None


quantize_pass.dispatch = _dispatch  # read by prunus.compress.recipe.check_pass


__all__ = ["SCHEMES", "SCHEME_PASSES", "eight_bit_pass", "linear_names", "quantize_pass", "scheme_options", "scheme_pass"]
