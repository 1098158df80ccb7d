"""int4 weight-only: packing, the module, the algorithms (RTN, GPTQ, AWQ, HQQ) and their error bounds."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prunus.compress.awq import awq_scale, fold, fold_targets
from prunus.compress.gptq import gptq_int4, hessians
from prunus.compress.hqq import hqq_int4
from prunus.compress.int4 import int4_pass
from prunus.artifacts.errors import PrunusError
from prunus.models.compression_state import compression_state
from prunus.models.int4 import (check_group_size, default_group_size, dequantize_int4, expand_groups, pack_int4,
                                pack_zero_points, quantize_int4, rtn_int4, unpack_int4)
from prunus.models.quant_registry import is_quantized
from prunus.models.quantized import QuantizedLinear
from prunus.models.quantized_int4 import Int4Linear, tinygemm_available


class Ctx:
    """The part of a PassContext the int4 pass reads: calibration batches and notes."""

    def __init__(self, vocab: int):
        self.vocab, self.notes = vocab, []

    def calibration(self, n):
        g = torch.Generator().manual_seed(1)
        return [torch.randint(0, self.vocab, (2, 32), generator=g) for _ in range(n)]

    def note(self, line):
        self.notes.append(line)


@pytest.fixture
def ctx(tiny_model):
    return Ctx(tiny_model.config.vocab_size)


def test_pack_unpack_round_trip_is_exact():
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 2), (7, 64), (33, 192)]:
        q = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
        packed = pack_int4(q)
        assert packed.dtype == torch.uint8 and packed.shape == (shape[0], shape[1] // 2)
        assert torch.equal(unpack_int4(packed), q)
        assert torch.equal(packed[:, 0] & 0xF, q[:, 0]) and torch.equal(packed[:, 0] >> 4, q[:, 1])  # low nibble first
    z = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.uint8)  # odd group count: each row padded to a byte
    assert pack_zero_points(z).tolist() == [1 | 2 << 4, 3 | 8 << 4, 4 | 5 << 4, 6 | 8 << 4]


def test_default_group_size_and_bad_group_size():
    assert default_group_size(576) == 64 and default_group_size(1536) == 128 and default_group_size(96) == 32
    with pytest.raises(PrunusError, match="layers.0.attention.wq.*does not divide in_features 576"):
        check_group_size(128, 576, "quantize layers.0.attention.wq")
    with pytest.raises(PrunusError, match="must be one of 32, 64, 128"):
        check_group_size(48, 96, "quantize x")
    with pytest.raises(PrunusError, match="not a multiple of 32"):
        check_group_size(None, 80, "quantize x")


def test_symmetric_rtn_puts_the_largest_magnitude_on_the_long_end():
    """Each group's value of largest magnitude is exact (q = 0, a negative scale when it is positive), and the
    squared error is below the positive-only scale max(-min / 8, max / 7)'s, as ONNX Runtime's blocks are."""
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    q, s, z = rtn_int4(w, 64, True)
    groups = w.reshape(64, 4, 64)
    extreme = groups.gather(2, groups.abs().argmax(2, keepdim=True)).squeeze(2)
    assert ((s < 0) == (extreme > 0)).all() and (s < 0).any() and (s > 0).any()
    assert torch.equal(q.reshape(64, 4, 64).gather(2, groups.abs().argmax(2, keepdim=True)).squeeze(2),
                       torch.zeros_like(extreme, dtype=torch.uint8))
    lo, hi = groups.amin(2), groups.amax(2)
    positive = torch.maximum(-lo / 8, hi / 7)
    err = (dequantize_int4(q, s, z, 64) - w).pow(2).sum()
    old = (dequantize_int4(quantize_int4(w, positive, z, 64), positive, z, 64) - w).pow(2).sum()
    assert err < 0.95 * old


@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_grid_and_module_forward(symmetric):
    torch.manual_seed(0)
    lin = nn.Linear(128, 24, bias=True)
    q, s, z = rtn_int4(lin.weight, 64, symmetric)
    w = dequantize_int4(q, s, z, 64)
    step = expand_groups(s.abs(), 64)
    err = (w - lin.weight).abs()
    inside = q != 15 if symmetric else torch.ones_like(q, dtype=torch.bool)  # symmetric: the short end may clip
    assert q.max() <= 15 and (err[inside] <= step[inside] / 2 + 1e-6).all() and (err <= step + 1e-6).all()
    if symmetric:
        assert (z == 8).all()
    m = Int4Linear.from_quantized(lin, q, s, z, 64, symmetric, "rtn")
    x = torch.randn(3, 5, 128)
    torch.testing.assert_close(m(x), F.linear(x, w, lin.bias), rtol=1e-5, atol=1e-5)
    assert is_quantized(m) and m.weight.dtype == torch.uint8 and m.weight.shape == (24, 64)
    assert torch.equal(m.to(torch.bfloat16).weight_scale.float(), m.weight_scale.float())


def _correlated_inputs(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    scale = torch.logspace(-1, 1, k)[torch.randperm(k, generator=g)]  # some channels much larger
    return (torch.randn(n, k, generator=g) @ mix) * scale


@pytest.mark.parametrize("symmetric,act_order", [(True, False), (False, False), (False, True)])
def test_gptq_beats_rtn_on_the_layer_output(symmetric, act_order):
    torch.manual_seed(0)
    lin = nn.Linear(256, 64, bias=False)
    x = _correlated_inputs(2048, 256)
    H = 2 * x.t() @ x / x.shape[0]
    ref = x @ lin.weight.detach().t()
    err = lambda q, s, z: float((x @ dequantize_int4(q, s, z, 64).t() - ref).pow(2).mean())  # noqa: E731
    e_rtn = err(*rtn_int4(lin.weight, 64, symmetric))
    e_gptq = err(*gptq_int4(lin.weight, H, 64, symmetric, act_order=act_order, block_size=128))
    assert e_gptq < 0.8 * e_rtn, (e_gptq, e_rtn)


def test_hessians_are_shared_by_modules_reading_one_tensor(tiny_model, ctx):
    names = ["layers.0.attention.wq", "layers.0.attention.wk", "layers.0.feed_forward.w2"]
    H = hessians(tiny_model, names, ctx.calibration(2))
    assert H["layers.0.attention.wq"] is H["layers.0.attention.wk"]
    assert H["layers.0.feed_forward.w2"].shape == (192, 192)
    assert torch.allclose(H["layers.0.feed_forward.w2"], H["layers.0.feed_forward.w2"].t())


@pytest.mark.parametrize("symmetric", [True, False])
def test_hqq_weight_error_at_most_rtn(symmetric):
    torch.manual_seed(0)
    w = torch.randn(64, 256) * 0.02
    w[torch.rand_like(w) < 0.01] *= 20  # outliers, which stretch round-to-nearest's range
    err = lambda q, s, z: float((dequantize_int4(q, s, z, 64) - w).pow(2).sum())  # noqa: E731
    e_rtn, e_hqq = err(*rtn_int4(w, 64, symmetric)), err(*hqq_int4(w, 64, symmetric))
    assert e_hqq < e_rtn, (e_hqq, e_rtn)


def test_awq_folding_is_exact_in_float(tiny_model, ctx):
    tokens = ctx.calibration(1)[0]
    ref = tiny_model(tokens).detach()
    model = copy.deepcopy(tiny_model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for kind, source, names in fold_targets(model):
            k = model.get_submodule(names[0]).in_features
            fold(kind, source, [model.get_submodule(n) for n in names], torch.rand(k, generator=g) * 4 + 0.25)
    torch.testing.assert_close(model(tokens), ref, rtol=1e-4, atol=1e-4)
    model = copy.deepcopy(tiny_model)  # the searched scales: still the same float function
    names = {n for n, m in model.named_modules() if type(m) is nn.Linear and n != "output"}
    alphas = awq_scale(model, ctx.calibration(2), names, lambda w: dequantize_int4(*rtn_int4(w, 64, True), 64))
    assert len(alphas) == 3 * len(model.layers)
    torch.testing.assert_close(model(tokens), ref, rtol=1e-4, atol=1e-4)


def test_int4_pass_mixes_precisions_and_reports_them(tiny_model, ctx):
    model = int4_pass(copy.deepcopy(tiny_model), ctx, algorithm="hqq", int8=["layers.-1"])
    assert isinstance(model.layers["0"].attention.wq, Int4Linear)
    assert type(model.layers["1"].feed_forward.w2) is QuantizedLinear
    assert type(model.output) is nn.Linear
    note = ctx.notes[-1]
    assert "int4-weight-only (hqq, symmetric, group 64): 7 modules" in note
    assert "int8-weight-only: layers.1" in note and "float: output" in note


@pytest.mark.parametrize("algorithm", ["rtn", "gptq", "awq", "hqq", "awq-gptq"])
def test_every_algorithm_keeps_the_model_close(tiny_model, ctx, algorithm):
    tokens = ctx.calibration(1)[0]
    ref = tiny_model(tokens).detach()
    model = int4_pass(copy.deepcopy(tiny_model), ctx, algorithm=algorithm, symmetric=False, n_calib=2)
    rel = float((model(tokens).detach() - ref).norm() / ref.norm())
    assert rel < 0.05, rel
    spec = compression_state(model).quantized_modules["layers.0.attention.wq"]
    assert spec == {"scheme": "int4-weight-only", "granularity": "per_group", "group_size": 64, "symmetric": False,
                    "algorithm": algorithm}


def test_bad_int4_requests_are_one_clear_error(tiny_model, ctx):
    with pytest.raises(PrunusError, match="unknown int4 algorithm 'awq2'"):
        int4_pass(copy.deepcopy(tiny_model), ctx, algorithm="awq2")
    with pytest.raises(PrunusError, match=r"quantize layers\.0\.feed_forward\.w2: group_size 128 does not divide in_features 192"):
        int4_pass(copy.deepcopy(tiny_model), ctx, group_size=128, exclude=["output", "layers.0.attention", "layers.0.feed_forward.w1",
                                                                           "layers.0.feed_forward.w3"])
    with pytest.raises(PrunusError, match="gptq needs calibration data"):
        int4_pass(copy.deepcopy(tiny_model), None, algorithm="gptq")
    with pytest.raises(PrunusError, match="gptq needs calibration data"):
        int4_pass(copy.deepcopy(tiny_model), ctx, algorithm="gptq", n_calib=0)
    model = int4_pass(copy.deepcopy(tiny_model), ctx)
    with pytest.raises(PrunusError, match="already int4"):
        int4_pass(model, ctx)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="tinygemm (torch._weight_int4pack_mm) needs a CUDA GPU")
@pytest.mark.parametrize("group_size,symmetric", [(32, True), (64, False), (128, False)])
def test_tinygemm_matches_the_dequantizing_path(group_size, symmetric):
    torch.manual_seed(0)
    lin = nn.Linear(512, 256, bias=False)
    m = Int4Linear.from_quantized(lin, *rtn_int4(lin.weight, group_size, symmetric), group_size, symmetric, "rtn").cuda()
    x = torch.randn(8, 512, device="cuda").to(torch.bfloat16)
    assert tinygemm_available(x, m)
    y = m(x).float()
    # the reference: the same bf16 inputs, bf16-rounded scales and zeros as tinygemm takes them, float32 sums
    _, sz = m._tinygemm_weight()
    scale, zero = sz[..., 0].float().t(), sz[..., 1].float().t()
    q = m.unpacked().float()
    w = (q - 8) * scale.repeat_interleave(group_size, 1) + zero.repeat_interleave(group_size, 1)
    ref = x.float() @ w.t()
    rel = float((y - ref).norm() / ref.norm())
    assert rel < 4e-3, rel  # the output is bfloat16 (8 mantissa bits): 1e-4 is below its resolution


def test_quantize_pass_routes_int4_and_refuses_int4_arguments_elsewhere(tiny_model, ctx):
    from prunus.compress.quantize import quantize_pass

    model = quantize_pass(copy.deepcopy(tiny_model), ctx, scheme="int4-weight-only", algorithm="gptq", group_size=32,
                          symmetric=False, act_order=True, n_calib=2)
    assert model.layers["0"].feed_forward.w2.group_size == 32 and model.layers["0"].feed_forward.w2.algorithm == "gptq"
    with pytest.raises(PrunusError, match="are for scheme int4-weight-only"):
        quantize_pass(copy.deepcopy(tiny_model), ctx, scheme="int8-weight-only", algorithm="gptq")


def test_int4_model_dir_round_trip(tmp_path, tiny_model, ctx):
    from prunus.models import load_model, read_manifest, save_model
    from safetensors.torch import load_file

    model = int4_pass(copy.deepcopy(tiny_model), ctx, algorithm="hqq", symmetric=False, int8=["layers.1.feed_forward"])
    tokens = ctx.calibration(1)[0]
    ref = model(tokens).detach()
    save_model(model, tmp_path / "m", stage="compress")
    back = load_model(tmp_path / "m")
    torch.testing.assert_close(back(tokens).detach(), ref, rtol=0, atol=0)
    wq = back.layers["0"].attention.wq
    assert isinstance(wq, Int4Linear) and wq.symmetric is False and wq.algorithm == "hqq"
    assert type(back.layers["1"].feed_forward.w1) is QuantizedLinear
    state = load_file(tmp_path / "m" / "model.safetensors")
    assert state["layers.0.attention.wq.weight"].dtype == torch.uint8
    assert state["layers.0.attention.wq.weight"].shape == (64, 32)
    assert state["layers.0.attention.wq.weight_zero"].shape == (64, 1)
    assert "model.safetensors" in read_manifest(tmp_path / "m")["files"]


def test_cli_int4_compress_and_bad_input(tmp_path, trained_run, text_file):
    from click.testing import CliRunner

    from prunus.cli.main import cli
    from prunus.models import load_model

    run = lambda *a: CliRunner().invoke(cli, [str(x) for x in a])  # noqa: E731
    common = ["--data", text_file, "--eval-tokens", 1024, "--max-corpus-bytes", 200000, "--no-latency"]
    model_dir, out = trained_run / "model", tmp_path / "int4"
    recipe = tmp_path / "mixed.yaml"
    recipe.write_text("passes:\n  - quantize: {scheme: int4-weight-only, algorithm: gptq, symmetric: false, "
                      "n_calib: 2, int8: [layers.-1]}\n")
    r = run("compress", model_dir, "--recipe", recipe, "--out", out, *common)
    assert r.exit_code == 0, r.output
    report = (out / "report.md").read_text()
    assert "int4-weight-only (gptq, asymmetric, group 64): 7 modules; int8-weight-only: layers.1; float: output" in report
    model = load_model(out)
    assert isinstance(model.layers["0"].feed_forward.w2, Int4Linear) and model.layers["0"].feed_forward.w2.group_size == 64
    for text, needles in [
        ("{scheme: int4-weight-only, group_size: 128}", ["quantize layers.0.attention.wq", "does not divide in_features 64"]),
        ("{scheme: int4-weight-only, algorithm: squeeze}", ["quantize.algorithm='squeeze' is not valid; use one of rtn"]),
        ("{scheme: int4-weight-only, algorithm: gptq, n_calib: 0}", ["n_calib"]),
    ]:
        recipe.write_text(f"passes:\n  - quantize: {text}\n")
        _last_line_error(run("compress", model_dir, "--recipe", recipe, "--out", tmp_path / "o", *common), *needles)
        assert not (tmp_path / "o").exists()
    _last_line_error(run("compress", out, "--quantize", "int4-weight-only", "--out", tmp_path / "o", *common),
                     "already int4")
    assert not (tmp_path / "o").exists()


def _last_line_error(result, *needles):
    """Exit code 2 and, after the runner's progress lines (the pass being run), one Error line with the needles."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("Error: ") and sum(line.startswith("Error") for line in lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[-1], lines[-1]


def test_int4_group_64_is_under_0_30_of_fp16():
    m = Int4Linear(576, 1536, group_size=64)
    stored = sum(b.numel() * b.element_size() for b in m.buffers())  # packed values, float32 scales, uint8 zeros
    assert stored <= 0.30 * 576 * 1536 * 2, stored / (576 * 1536 * 2)


@pytest.mark.parametrize("float_zero", [False, True])
@pytest.mark.parametrize("style", ["column", "row"])
def test_tensor_parallel_slices_of_an_int4_layer_add_up(style, float_zero):
    from prunus.runtime.tp_shard import shard_linear

    torch.manual_seed(0)
    lin = nn.Linear(128, 64, bias=False)
    full = Int4Linear.from_quantized(lin, *rtn_int4(lin.weight, 32, False, float_zero), 32, False, "rtn",
                                     float_zero=float_zero)
    x = torch.randn(3, 128)
    parts = []
    for rank in range(2):
        shard = copy.deepcopy(full)
        shard_linear(shard, style, rank, 2)
        parts.append(shard(x[:, rank * 64:(rank + 1) * 64] if style == "row" else x))
    got = torch.cat(parts, dim=-1) if style == "column" else parts[0] + parts[1]
    torch.testing.assert_close(got, full(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", ["int4-hqq-g64", "int4-gptq-g64", "int4-awq-gptq-g64", "int4-mixed"])
def test_shipped_int4_recipes_quantize_the_head_to_int8_and_untie_it(ctx, recipe):
    """The output head (a fifth of SmolLM2-135M's weights) is int8 per channel in every shipped int4 recipe; a tied
    head gets its own copy first, and the embedding table stays float."""
    from prunus.compress.recipe import get_pass, load_recipe
    from prunus.models import Transformer, get_preset

    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(tie_embeddings=True, n_layers=3))
    model.init_weights()
    table = model.tok_embeddings.weight.detach().clone()
    (name, args), = load_recipe(recipe)[0]
    model = get_pass(name)(model, Ctx(model.config.vocab_size), **args)
    assert type(model.output) is QuantizedLinear and model.output.spec()["scheme"] == "int8-weight-only"
    assert model.output.spec()["granularity"] == "per_channel"
    assert not model.config.tie_embeddings and compression_state(model).quantization["untied_output"]
    assert torch.equal(model.tok_embeddings.weight, table) and model.tok_embeddings.weight.dtype == torch.float32
    assert type(model.layers["1"].attention.wq) is Int4Linear
    assert type(model.layers["0"].feed_forward.w2) is (QuantizedLinear if recipe == "int4-mixed" else Int4Linear)


@pytest.mark.parametrize("symmetric", [True, False])
def test_hqq_weight_error_is_below_rtn_on_every_layer(tiny_model, symmetric):
    """Per layer of a model (not only on planted outliers): HQQ's squared weight error is at most round to
    nearest's (HQQ keeps, per group, the better of the two) and below it on every layer."""
    for name, m in tiny_model.named_modules():
        if type(m) is nn.Linear:
            w = m.weight.detach().float()
            err = lambda q, s, z: float((dequantize_int4(q, s, z, 64) - w).pow(2).sum())  # noqa: E731
            e_rtn, e_hqq = err(*rtn_int4(w, 64, symmetric)), err(*hqq_int4(w, 64, symmetric))
            assert e_hqq < e_rtn, (name, e_hqq, e_rtn)


@pytest.mark.parametrize("symmetric", [True, False])
def test_round_to_nearest_writes_onnx_runtimes_integers_bit_for_bit(symmetric):
    """The same packed values, scales and zero points as ONNX Runtime's ``quantize_matmul_4bits``, on weights that
    lie on a coarser grid (as weights dequantized from a GGUF do), where exact halves are common."""
    import numpy as np

    pybind = pytest.importorskip("onnxruntime.capi._pybind_state")
    g = torch.Generator().manual_seed(0)
    n, k, bs = 96, 576, 64
    w = torch.randint(-30, 31, (n, k), generator=g).float() / 256  # on a grid: step 4 / 256, halves at m % 4 == 2
    w[:, ::bs], w[:, 1::bs] = -30 / 256, 30 / 256  # (and the zero point 7.5 a half too)
    w[n // 2:] = torch.randn(n - n // 2, k, generator=g) * 0.05  # and ordinary weights
    packed = np.zeros((n, k // bs, bs // 2), dtype=np.uint8)
    scales = np.zeros(n * (k // bs), dtype=np.float32)
    zeros = np.zeros(n * ((k // bs + 1) // 2), dtype=np.uint8)
    pybind.quantize_matmul_4bits(packed, np.ascontiguousarray(w.t().numpy()), scales, zeros, bs, n, k, symmetric)
    q, s, z = rtn_int4(w, bs, symmetric)
    assert np.array_equal(pack_int4(q).numpy().reshape(packed.shape), packed)
    assert np.array_equal(s.numpy().reshape(-1), scales)
    if not symmetric:
        assert np.array_equal(pack_zero_points(z).numpy(), zeros)
        halves = (w.reshape(n, -1, bs) / s.unsqueeze(2) + 7.5) % 1 == 0.5
        assert halves.sum() > 1000 and (z[: n // 2] == 8).all()  # the cases the rounding rule decides
