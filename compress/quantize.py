"""The quantize pass: every Linear of the model (but the excluded ones) becomes a QuantizedLinear.

Weights get symmetric absmax scales (per tensor, per output channel or per group of
input channels). ``w8a8-static`` also calibrates one activation scale per module on
calibration batches (``minmax`` or ``percentile``). The output head is excluded by
default; a model with tied embeddings whose head is quantized is untied first (the
embedding table stays in float), and the config records it. ``exclude`` takes module
names, parents and globs; ``layers.-K`` names the K-th block from the end, so a recipe can
keep the last block in float whatever the depth (the fp8 recipes do: on SmolLM2-135M the
last block holds most of fp8's error).
"""

from __future__ import annotations

import torch
from torch import nn

from prunus.artifacts.errors import PrunusError
from prunus.models.compression_state import compression_state
from prunus.models.quantized import INT8_MAX, SCHEMES, QuantizedLinear, check_scheme

from .calibrate import input_absmax
from .options import check_calibration
from .select import exclude_list, float_linears


def linear_names(model: nn.Module, exclude=()) -> tuple[list[str], list[str]]:
    """(names of the float Linear modules to quantize, names of those excluded); see ``select.py``."""
    chosen, skipped = float_linears(model, exclude, where="quantize")
    return list(chosen), skipped


def untie_output(model: nn.Module) -> None:
    """Give the output head its own copy of the embedding table."""
    model.output.weight = nn.Parameter(model.output.weight.detach().clone())
    model.config = model.config.replace(tie_embeddings=False)


def quantize_pass(model, ctx, *, scheme: str, granularity: str = "per_channel", group_size: int | None = None,
                  calibration: str = "minmax", percentile: float = 99.99, n_calib: int = 8,
                  exclude: str | list | tuple = ("output",),
                  algorithm: str | None = None, symmetric: bool = True, act_order: bool = False, damp: float = 0.01,
                  int8: str | list | tuple = (), float_zero: bool = False, clip: str = "none"):
    """Replace every float Linear not in ``exclude`` by a QuantizedLinear of ``scheme``, in place; record the
    layout in the model's CompressionState (``quantization``). Returns ``model``.

    ``int4-weight-only`` goes to :func:`prunus.compress.int4.int4_pass` with ``algorithm`` (rtn, gptq, awq,
    hqq), ``group_size`` (None: 128 / 64 / 32 per layer), ``symmetric``, ``float_zero``, ``act_order`` and ``damp``
    (gptq), and ``int8`` (modules or blocks kept at int8 weight-only); those arguments are for int4 only."""
    if scheme == "int4-weight-only":
        from .int4 import int4_pass

        return int4_pass(model, ctx, algorithm=algorithm or "rtn", group_size=group_size, symmetric=symmetric,
                         act_order=act_order, damp=damp, int8=int8, exclude=exclude, n_calib=n_calib,
                         float_zero=float_zero, clip=clip)
    if (algorithm is not None or int8 or symmetric is not True or act_order or damp != 0.01 or float_zero
            or clip != "none"):
        raise PrunusError(f"quantize: algorithm, symmetric, float_zero, clip, act_order, damp and int8 are for scheme "
                          f"int4-weight-only, "
                          f"not {scheme}; drop them")
    check_scheme(scheme, granularity, group_size)
    check_calibration(calibration, percentile)
    exclude = exclude_list(exclude)
    names, skipped = linear_names(model, exclude)
    if not names:
        raise PrunusError(f"quantize: exclude={exclude} leaves no Linear module to quantize; exclude fewer")
    for name in names:
        check_scheme(scheme, granularity, group_size, model.get_submodule(name).in_features, where=f"quantize {name}")
    state = compression_state(model)
    info = state.quantization or {"modules": {}, "excluded": []}
    if "output" in names and model.config.tie_embeddings:
        untie_output(model)
        info["untied_output"] = True
    input_scales = {}
    if scheme == "w8a8-static":
        batches = ctx.calibration(n_calib)
        amax = input_absmax(model, names, batches, method=calibration, percentile=percentile)
        input_scales = {n: max(a, 1e-12) / INT8_MAX for n, a in amax.items()}
        info["calibration"] = {"method": calibration, "n_batches": n_calib,
                               **({"percentile": percentile} if calibration == "percentile" else {})}
    with torch.no_grad():
        for name in names:
            q = QuantizedLinear.from_linear(model.get_submodule(name), scheme, granularity, group_size,
                                            input_scale=input_scales.get(name))
            model.set_submodule(name, q)
            info["modules"][name] = q.spec()
    info["excluded"] = sorted(set(info.get("excluded", [])) | set(skipped))
    state.quantization = info
    return model


__all__ = ["SCHEMES", "quantize_pass", "linear_names"]
