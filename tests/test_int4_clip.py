"""Clipped int4 grids (``clip: mse``): the per-group range search, GPTQ with it, and its arguments."""

from __future__ import annotations

import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.compress.gptq import gptq_int4
from prunus.compress.int4 import int4_pass
from prunus.compress.int4_clip import MAX_SHRINK, NORM, clip_params
from prunus.compress.quantize import quantize_pass
from prunus.compress.recipe import check_pass
from prunus.models.int4 import QMAX, dequantize_int4, quantize_int4, rtn_params
from test_int4 import Ctx, _correlated_inputs


def _group_error(w, scale, zero, group_size, imp=None):
    dq = dequantize_int4(quantize_int4(w, scale, zero, group_size), scale, zero, group_size)
    err = (dq - w).abs().pow(NORM) * (1 if imp is None else imp)
    return err.reshape(w.shape[0], -1, group_size).sum(2)


def _heavy_tailed(rows, cols, seed=0):
    """Gaussian weights with a few values per group up to 9x larger (as trained LLM weights have)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.rand(rows, cols, generator=g).pow(6).mul(8).add(1) * 0.02


@pytest.mark.parametrize("symmetric,float_zero", [(True, False), (False, False), (False, True)])
def test_every_group_is_at_most_round_to_nearest_on_the_searched_error(symmetric, float_zero):
    w = _heavy_tailed(48, 256)
    imp = torch.rand(256, generator=torch.Generator().manual_seed(3)) + 0.1
    for weight in (None, imp):
        s0, z0 = rtn_params(w, 64, symmetric, float_zero)
        s, z = clip_params(w, 64, symmetric, float_zero, weight)
        assert s.shape == s0.shape and z.dtype == z0.dtype
        assert (_group_error(w, s, z, 64, weight) <= _group_error(w, s0, z0, 64, weight) * (1 + 1e-6)).all()
        ratio = s / s0  # the range shrinks by at most MAX_SHRINK, never grows
        assert (ratio <= 1 + 1e-6).all() and (ratio >= 1 - MAX_SHRINK - 1e-6).all()
        assert (ratio < 1 - 1e-3).float().mean() > 0.2  # heavy tails: many groups clip
        q = quantize_int4(w, s, z, 64)
        assert int(q.max()) <= QMAX


def test_an_outlier_is_clipped_and_the_rest_rounds_more_finely():
    w = torch.linspace(-0.1, 0.1, 64).reshape(1, 64).clone()
    w[0, 5] = 0.3  # one outlier stretches the round-to-nearest step
    s0, z0 = rtn_params(w, 64, False)
    s, z = clip_params(w, 64, False)
    assert float(s) < float(s0)
    rest = torch.ones(64, dtype=torch.bool)
    rest[5] = False
    dq0 = dequantize_int4(quantize_int4(w, s0, z0, 64), s0, z0, 64)
    dq = dequantize_int4(quantize_int4(w, s, z, 64), s, z, 64)
    assert (dq - w)[0, rest].abs().mean() < (dq0 - w)[0, rest].abs().mean()


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_clipped_grids_lowers_the_layer_output_error(act_order):
    """On heavy-tailed weights and correlated inputs, the Hessian-weighted range search gives GPTQ a lower
    output error ||X W^T - X Q^T|| than GPTQ on each group's whole range."""
    w = _heavy_tailed(64, 256, seed=1)
    x = _correlated_inputs(1024, 256)
    H = 2 * x.t() @ x / x.shape[0]
    errors = {}
    for clip in ("none", "mse"):
        q, s, z = gptq_int4(w, H, 64, False, act_order=act_order, clip=clip)
        errors[clip] = float((x @ (dequantize_int4(q, s, z, 64) - w).t()).pow(2).mean())
    assert errors["mse"] < errors["none"]


def test_the_pass_reports_the_clip_and_refuses_bad_requests(tiny_model):
    ctx = Ctx(tiny_model.config.vocab_size)
    int4_pass(tiny_model, ctx, algorithm="gptq", group_size=32, symmetric=False, clip="mse")
    assert "ranges clipped by mse search" in ctx.notes[-1]
    check_pass("quantize", {"scheme": "int4-weight-only", "algorithm": "gptq", "clip": "mse"})
    with pytest.raises(PrunusError, match="unknown clip 'max'.*none, mse"):
        int4_pass(tiny_model, ctx, algorithm="rtn", clip="max")
    with pytest.raises(PrunusError, match="hqq fits its own grid"):
        int4_pass(tiny_model, ctx, algorithm="hqq", clip="mse")
    with pytest.raises(PrunusError, match="clip.*are for scheme int4-weight-only"):
        quantize_pass(tiny_model, ctx, scheme="int8-weight-only", clip="mse")
