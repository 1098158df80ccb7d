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

from fnmatch import fnmatch

import torch
from torch import nn

from prunus.models import PrunusError
from prunus.models.quantized import INT8_MAX, SCHEMES, QuantizedLinear, check_scheme

from .calibrate import METHODS, input_absmax


def is_excluded(name: str, exclude) -> bool:
    """A module is excluded by its name, a parent's name ("layers.0") or a glob ("*.w2")."""
    return any(name == p or name.startswith(p + ".") or fnmatch(name, p) for p in exclude)


def resolve_blocks(model: nn.Module, exclude) -> list[str]:
    """``exclude`` with ``layers.-K`` (and ``layers.-K.rest``) resolved to the model's K-th block from the end."""
    keys = list(getattr(model, "layers", {}) or {})
    out = []
    for p in exclude:
        head, _, rest = p.partition(".")
        index, _, tail = rest.partition(".")
        if head == "layers" and index.startswith("-") and index[1:].isdigit():
            k = int(index)
            if not keys or -k > len(keys):
                raise PrunusError(f"quantize: exclude {p!r}: the model has {len(keys)} blocks")
            p = f"layers.{keys[k]}" + (f".{tail}" if tail else "")
        out.append(p)
    return out


def linear_names(model: nn.Module, exclude=()) -> tuple[list[str], list[str]]:
    """(names of the float Linear modules to quantize, names of those excluded)."""
    exclude = resolve_blocks(model, exclude)
    chosen, skipped = [], []
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            # a mixture-of-experts router stays in float: rounding flips which experts a token goes to
            excluded = is_excluded(name, exclude) or name.endswith(".router")
            (skipped if excluded else chosen).append(name)
    return chosen, skipped


def untie_output(model: nn.Module) -> None:
    """Give the output head its own copy of the embedding table."""
    model.output.weight = nn.Parameter(model.output.weight.detach().clone())
    model.config = model.config.replace(tie_embeddings=False)


def quantize_pass(model, ctx, *, scheme: str, granularity: str = "per_channel", group_size: int | None = None,
                  calibration: str = "minmax", percentile: float = 99.99, n_calib: int = 8, exclude=("output",)):
    check_scheme(scheme, granularity, group_size)
    if calibration not in METHODS:
        raise PrunusError(f"quantize: unknown calibration {calibration!r}; choose one of: {', '.join(METHODS)}")
    exclude = [exclude] if isinstance(exclude, str) else list(exclude or ())
    names, skipped = linear_names(model, exclude)
    if not names:
        raise PrunusError(f"quantize: exclude={exclude} leaves no Linear module to quantize; exclude fewer")
    for name in names:
        check_scheme(scheme, granularity, group_size, model.get_submodule(name).in_features, where=f"quantize {name}")
    info = (getattr(model, "compression", None) or {}).get("quantization") or {"modules": {}, "excluded": []}
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
    if getattr(model, "compression", None) is None:
        model.compression = {}
    model.compression["quantization"] = info
    return model


__all__ = ["SCHEMES", "quantize_pass", "linear_names", "is_excluded"]
