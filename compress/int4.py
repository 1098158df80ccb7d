"""The int4 weight-only pass: every chosen Linear becomes an Int4Linear (packed int4, per-group scales).

``quantize: {scheme: int4-weight-only, algorithm: rtn | gptq | awq | hqq, group_size, symmetric, float_zero, clip}``

* ``rtn``: round to nearest on each group's range (:mod:`prunus.models.int4`);
* ``gptq``: error-compensating column order updates on calibration Hessians (:mod:`.gptq`);
* ``awq``: per-channel scales searched on calibration activations and folded into the
  model, then round to nearest (:mod:`.awq`);
* ``hqq``: calibration-free half-quadratic fit of scales and zero points (:mod:`.hqq`);
* ``awq-gptq``: AWQ's scales folded first, then GPTQ on the scaled weights (on SmolLM2-135M the best
  of these, ahead of AWQ alone and GPTQ alone: docs/results.md, int4 on SmolLM2).

``clip: mse`` fits each group's range by a search (:mod:`.int4_clip`) instead of spanning it whole;
GPTQ and AWQ weigh the search by their calibration Hessian's diagonal. On SmolLM2-135M it helps GPTQ
and AWQ then GPTQ but not round to nearest or AWQ alone (docs/results.md); likely because GPTQ passes a
clipped value's error on to the columns after it, where round to nearest leaves it in the output.

``float_zero`` (asymmetric only) keeps each group's zero point as a float, as torchao's and ONNX
Runtime's HQQ and llama.cpp's Q4_1 do (:mod:`prunus.models.int4`); round to nearest then spans each
group's own min and max. ``group_size`` None takes, per layer, the largest of 128 / 64 / 32 dividing its input
features; a given group size that does not divide a layer's width is refused naming the
layer. ``int8`` lists modules or blocks (``layers.0``, ``layers.-1``, globs) that get
int8 weight-only per-channel weights instead: mixed precision, recorded per module in
config.json and listed in the report's notes. ``exclude`` (modules left in float) defaults to the
output head unless ``int8`` names it: ``int8: [output]`` alone puts the head at int8. A module
named both in ``int8`` and in a given ``exclude`` is refused, not settled silently.
"""

from __future__ import annotations

import torch

from prunus.artifacts.errors import PrunusError
from prunus.models.compression_state import compression_state
from prunus.models.int4 import INT4_SCHEME, check_group_size, dequantize_int4, quantize_int4, rtn_params
from prunus.models.quant_registry import handler
from prunus.models.quantized_int4 import Int4Linear

from .gguf_scales import round_scales
from .int4_clip import CLIPS, grid_params
from .options import INT4_ALGORITHMS as ALGORITHMS
from .select import DEFAULT_EXCLUDE, check_named, exclude_list, float_linears, given_exclude, is_excluded, resolve_blocks
from .untie_output import untie_output

CALIBRATED = ("gptq", "awq", "awq-gptq")


def _state(model):
    """The model's quantization record (a dict) and a function storing it back in its CompressionState."""
    state = compression_state(model)
    return state.quantization or {"modules": {}, "excluded": []}, lambda value: setattr(state, "quantization", value)


def check_args(model, algorithm: str, symmetric, act_order, damp, float_zero=False, clip="none") -> None:
    if algorithm not in ALGORITHMS:
        raise PrunusError(f"quantize: unknown int4 algorithm {algorithm!r}; choose one of: {', '.join(ALGORITHMS)}")
    if clip not in CLIPS:
        raise PrunusError(f"quantize: unknown clip {clip!r}; choose one of: {', '.join(CLIPS)}")
    if clip != "none" and algorithm == "hqq":
        raise PrunusError("quantize: clip is for rtn, gptq, awq and awq-gptq; hqq fits its own grid (drop clip)")
    if not all(isinstance(v, bool) for v in (symmetric, act_order, float_zero)):
        raise PrunusError("quantize: symmetric, act_order and float_zero must be true or false")
    if float_zero and symmetric:
        raise PrunusError("quantize: float_zero is for asymmetric int4 (a symmetric grid's zero point is 8); "
                          "add symmetric: false, or drop float_zero")
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 < damp < 1:
        raise PrunusError(f"quantize: damp={damp!r} must be a number in (0, 1) (0.01 is usual)")
    n_int4 = sum(isinstance(m, Int4Linear) for m in model.modules())
    if n_int4:
        raise PrunusError(f"quantize: the model is already int4 ({n_int4} int4 modules); quantize its float parent instead")


def choose_modules(model, exclude, int8) -> tuple[list[str], list[str], list[str]]:
    """(int4 names, int8 names, names left in float). ``exclude`` None: :data:`DEFAULT_EXCLUDE` but what
    ``int8`` names (``int8: [output]`` quantizes the head to int8 without ``exclude: []``); a module both in
    ``int8`` and in a given ``exclude`` is refused, and so is a pattern that names no module."""
    int8 = exclude_list(int8)
    patterns = resolve_blocks(model, int8, "quantize")
    linears = float_linears(model, (), "quantize")[0]
    check_named(linears, int8, patterns, "int8", "quantize", what="float Linear module")
    eight = [n for n in linears if is_excluded(n, patterns)]
    if exclude is None:  # the default, but what int8 names
        exclude = [p for p in DEFAULT_EXCLUDE if not any(is_excluded(n, [p]) for n in eight)]
    else:
        exclude = given_exclude(model, exclude, "quantize")
    chosen, skipped = float_linears(model, exclude, "quantize")
    both = [n for n in eight if n not in chosen]
    if both:
        raise PrunusError(f"quantize: {', '.join(_compact(both))} in both int8={int8} and exclude={exclude}; "
                          "keep each module in one list (int8: quantized to int8, exclude: left in float)")
    int8_names = [n for n in chosen if n in set(eight)]
    int4_names = [n for n in chosen if n not in set(eight)]
    if not int4_names:
        raise PrunusError(f"quantize: exclude={exclude} and int8={int8} leave no Linear module for int4; list fewer")
    return int4_names, int8_names, skipped


def calibration(ctx, algorithm: str, n_calib) -> list[torch.Tensor]:
    if algorithm not in CALIBRATED:
        return []
    if ctx is None or isinstance(n_calib, bool) or not isinstance(n_calib, int) or n_calib < 1:
        raise PrunusError(f"quantize: {algorithm} needs calibration data (a corpus and n_calib >= 1); "
                          "give --data or use algorithm hqq or rtn, which need none")
    batches = ctx.calibration(n_calib)
    if not batches or not all(b.numel() for b in batches):
        raise PrunusError(f"quantize: {algorithm} found no calibration tokens; give --data with more text")
    return batches


def int4_pass(model, ctx, *, algorithm: str = "rtn", group_size: int | None = None, symmetric: bool = True,
              act_order: bool = False, damp: float = 0.01, int8: str | list | tuple = (),
              exclude: str | list | tuple | None = None, n_calib: int = 8, float_zero: bool = False, clip: str = "none",
              gguf_scales: bool = False):
    """Quantize ``model`` in place as described in the module docstring; returns it. ``gguf_scales``: scales
    rounded so that GGUF's Q4_0 / Q4_1 / Q8_0 blocks hold the weights exactly (:mod:`prunus.compress.gguf_scales`)."""
    check_args(model, algorithm, symmetric, act_order, damp, float_zero, clip)
    if gguf_scales and float_zero:
        raise PrunusError("quantize: gguf_scales needs integer zero points (Q4_1 holds z·s as a half); drop float_zero")
    int4_names, int8_names, skipped = choose_modules(model, exclude, int8)
    groups = {n: check_group_size(group_size, model.get_submodule(n).in_features, f"quantize {n}") for n in int4_names}
    batches = calibration(ctx, algorithm, n_calib)
    info, store = _state(model)
    if "output" in int4_names + int8_names and model.config.tie_embeddings:
        untie_output(model)
        info["untied_output"] = True

    def fake_quant(w: torch.Tensor) -> torch.Tensor:
        g = check_group_size(group_size, w.shape[1], "quantize")
        scale, zero = rtn_params(w, g, symmetric, float_zero)  # AWQ's search rounds each group's whole range
        return dequantize_int4(quantize_int4(w, scale, zero, g), scale, zero, g)

    with torch.no_grad():
        if algorithm in ("awq", "awq-gptq"):
            from .awq import awq_scale

            alphas = awq_scale(model, batches, set(int4_names), fake_quant)
            if ctx is not None and alphas:
                ctx.note(f"awq: alpha per fold, mean {sum(alphas.values()) / len(alphas):.2f} over {len(alphas)} folds")
        for name in int8_names:  # before GPTQ, so that its block-by-block inputs see them
            q8 = handler("int8-weight-only").quantize(model.get_submodule(name), "per_channel")
            model.set_submodule(name, q8)
            info["modules"][name] = q8.spec()

        def replace(name: str, hessian=None) -> None:
            linear = model.get_submodule(name)
            q, s, z = quantize_weight(linear.weight, groups[name], symmetric, algorithm, hessian,
                                      act_order=act_order, damp=damp, float_zero=float_zero, clip=clip)
            model.set_submodule(name, handler(INT4_SCHEME).from_codes(linear, q, s, z, groups[name], symmetric, algorithm,
                                                                      float_zero=float_zero))
            info["modules"][name] = model.get_submodule(name).spec()

        hessians = {}
        # after the int8 layers: the Hessians see the inputs those produce (awq's clip search weighs by their diagonal)
        if algorithm in ("gptq", "awq-gptq") or (algorithm == "awq" and clip == "mse"):
            from .gptq import hessians as gptq_hessians

            hessians = gptq_hessians(model, int4_names, batches)
        for name in int4_names:
            replace(name, hessians.pop(name, None))
        if gguf_scales:  # after GPTQ, whose later columns compensate the earlier ones' rounding to the fitted scales
            round_scales(model, int8_names + int4_names)
            info["gguf_scales"] = True
            info["modules"].update({n: model.get_submodule(n).spec() for n in int8_names + int4_names})
    info["excluded"] = sorted(set(info.get("excluded", [])) | set(skipped))
    store(info)
    if ctx is not None:
        ctx.note(layout_note(int4_names, int8_names, skipped, groups, algorithm, symmetric, float_zero, clip))
    return model


def quantize_weight(w: torch.Tensor, group_size: int, symmetric: bool, algorithm: str, hessian=None, *,
                    act_order: bool = False, damp: float = 0.01, float_zero: bool = False, clip: str = "none"):
    """(unpacked int4 values, scale, zero point) of one weight by ``algorithm`` (awq: already folded, so RTN;
    awq-gptq: already folded, so GPTQ). A ``hessian`` given to RTN weighs the clip search by its diagonal."""
    if algorithm in ("gptq", "awq-gptq"):
        from .gptq import gptq_int4

        return gptq_int4(w, hessian, group_size, symmetric, damp=damp, act_order=act_order, float_zero=float_zero,
                         clip=clip)
    if algorithm == "hqq":
        from .hqq import hqq_int4

        return hqq_int4(w, group_size, symmetric, float_zero=float_zero)
    imp = None if hessian is None else torch.diag(hessian)
    scale, zero = grid_params(w, group_size, symmetric, float_zero, clip, imp)
    return quantize_int4(w, scale, zero, group_size), scale, zero


def layout_note(int4_names, int8_names, skipped, groups, algorithm, symmetric, float_zero=False, clip="none") -> str:
    """One line saying which layer got which precision."""
    sizes = sorted(set(groups.values()))
    grid = "symmetric" if symmetric else "asymmetric, float zero points" if float_zero else "asymmetric"
    grid += ", ranges clipped by mse search" if clip == "mse" else ""
    line = (f"{INT4_SCHEME} ({algorithm}, {grid}, group "
            f"{'/'.join(map(str, sizes))}): {len(int4_names)} modules")
    if int8_names:
        line += f"; int8-weight-only: {', '.join(_compact(int8_names))}"
    if skipped:
        line += f"; float: {', '.join(_compact(skipped))}"
    return line


def _compact(names: list[str]) -> list[str]:
    """Module names with whole blocks shortened to the block (layers.0.* -> layers.0)."""
    blocks: dict[str, list[str]] = {}
    for n in names:
        parts = n.split(".")
        key = ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 2 else n
        blocks.setdefault(key, []).append(n)
    return [k if len(v) > 1 else v[0] for k, v in blocks.items()]


__all__ = ["ALGORITHMS", "int4_pass", "quantize_weight"]
