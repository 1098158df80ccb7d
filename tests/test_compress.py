"""Quantization (QuantizedLinear, quantize and smoothquant passes), recipes, the compress runner, report and CLI."""

import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import load_file

from prunus.cli.main import cli
from prunus.compress import QualityDropError, compress, load_recipe, parse_recipe, shortcut_passes
from prunus.compress.context import build_context
from prunus.compress.quantize import quantize_pass
from prunus.compress.recipe import PASSES, RECIPES_DIR
from prunus.compress.smoothquant import smoothquant_pass
from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, get_preset, load_model, read_manifest, save_model, verify_model_dir
from prunus.models.compression_state import compression_state
from prunus.models.quantized import INT8_MAX, QuantizedLinear

# scheme, granularity, group_size, max relative error of the output against the float Linear
CASES = [
    ("int8-weight-only", "per_channel", None, 0.01),
    ("int8-weight-only", "per_group", 16, 0.01),
    ("int8-weight-only", "per_tensor", None, 0.015),
    ("w8a8-dynamic", "per_channel", None, 0.02),
    ("w8a8-static", "per_channel", None, 0.03),
    ("fp8-weight-only", "per_channel", None, 0.04),
    ("fp8-weight-only", "per_tensor", None, 0.04),
    ("fp8-w8a8", "per_channel", None, 0.06),
]


def run(*args):
    # a wide console whatever runs the tests (a pytest worker may set a narrow COLUMNS): tables keep whole cells
    return CliRunner().invoke(cli, [str(a) for a in args], env={"COLUMNS": "200"})


def rel_err(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("scheme,granularity,group_size,tol", CASES)
def test_quantized_linear_matches_float(scheme, granularity, group_size, tol):
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 96, bias=False)
    x = torch.randn(3, 7, 128)
    ref = linear(x)
    input_scale = x.abs().max() / INT8_MAX if scheme == "w8a8-static" else None
    q = QuantizedLinear.from_linear(linear, scheme, granularity, group_size, input_scale=input_scale)
    assert q.weight.dtype == (torch.float8_e4m3fn if scheme.startswith("fp8") else torch.int8)
    assert q.weight.shape == (96, 128) and q.weight_scale.dtype == torch.float32
    assert q.weight_scale.shape == {"per_channel": (96, 1), "per_tensor": (1, 1), "per_group": (96, 128 // 16)}[granularity]
    assert (q.input_scale is not None) == (scheme == "w8a8-static")
    y = q(x)
    assert rel_err(y, ref) < tol
    assert rel_err(q.dequantize(), linear.weight) < tol
    if "weight-only" in scheme:  # the forward pass is exactly x @ dequantize().T
        torch.testing.assert_close(y, F.linear(x, q.dequantize()), rtol=1e-5, atol=1e-5)
    # one token at a time gives the same rows as the whole batch (dynamic scales are per token)
    torch.testing.assert_close(q(x[:1, :1]), y[:1, :1], rtol=1e-5, atol=1e-5)
    assert q(x.bfloat16()).dtype == torch.bfloat16
    q.to(torch.bfloat16)  # storage and scales keep their dtypes
    assert q.weight.dtype in (torch.int8, torch.float8_e4m3fn) and q.weight_scale.dtype == torch.float32


def test_w8a8_integer_products_are_exact():
    """The CPU path computes int8 x int8 sums exactly: compare against int64 arithmetic."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(256, 64, bias=False)
    q = QuantizedLinear.from_linear(linear, "w8a8-dynamic")
    x = torch.randn(5, 256)
    xs = x.abs().amax(-1, keepdim=True) / INT8_MAX
    xq = (x / xs).round().clamp(-127, 127).to(torch.int64)
    ref = (xq @ q.weight.to(torch.int64).t()).double() * xs.double() * q.weight_scale.t().double()
    torch.testing.assert_close(q(x).double(), ref, rtol=1e-6, atol=1e-6)


def test_bad_scheme_arguments_are_refused():
    linear = torch.nn.Linear(64, 32, bias=False)
    with pytest.raises(PrunusError, match="unknown scheme 'int4'"):
        QuantizedLinear.from_linear(linear, "int4")
    with pytest.raises(PrunusError, match="group_size 24 does not divide in_features 64"):
        QuantizedLinear.from_linear(linear, "int8-weight-only", "per_group", 24)
    with pytest.raises(PrunusError, match="per_group scales are for int8-weight-only"):
        QuantizedLinear.from_linear(linear, "w8a8-dynamic", "per_group", 16)


@pytest.fixture
def tiny_dir(tmp_path, tiny_model):
    return save_model(tiny_model, tmp_path / "tiny", stage="test")


@pytest.fixture
def ctx(tiny_dir, text_file):
    return build_context(tiny_dir, data=str(text_file), seq_len=64, eval_tokens=1024)


@pytest.mark.parametrize("scheme,granularity,group_size", [("int8-weight-only", "per_group", 32),
                                                           ("w8a8-static", "per_channel", None),
                                                           ("fp8-w8a8", "per_tensor", None)])
def test_quantized_model_dir_round_trip(tmp_path, tiny_model, ctx, scheme, granularity, group_size):
    model = quantize_pass(tiny_model, ctx, scheme=scheme, granularity=granularity, group_size=group_size,
                          calibration="percentile", n_calib=2)
    assert isinstance(model.layers["0"].attention.wq, QuantizedLinear)
    assert type(model.output) is torch.nn.Linear  # excluded by default
    path = save_model(model, tmp_path / "q", stage="compress")
    config = json.loads((path / "config.json").read_text())
    assert config["compression"]["quantization"]["modules"]["layers.1.feed_forward.w2"]["scheme"] == scheme
    assert config["compression"]["quantization"]["excluded"] == ["output"]
    stored = load_file(path / "model.safetensors")
    assert stored["layers.0.attention.wq.weight"].dtype == model.layers["0"].attention.wq.weight.dtype
    assert ("layers.0.attention.wq.input_scale" in stored) == (scheme == "w8a8-static")
    loaded = load_model(path)
    tokens = torch.randint(0, 256, (2, 20))
    assert torch.equal(model(tokens), loaded(tokens))
    assert compression_state(loaded).to_json() == config["compression"]
    assert read_manifest(path)["metrics"]["params"] == get_preset("tiny").num_params()


def test_exclude_counts_blocks_from_the_end(tiny_model, ctx):
    model = quantize_pass(tiny_model, ctx, scheme="fp8-weight-only", exclude=["output", "layers.-1"])
    last = str(len(model.layers) - 1)
    assert type(model.layers[last].attention.wq) is torch.nn.Linear and isinstance(model.layers["0"].attention.wq, QuantizedLinear)
    assert f"layers.{last}.feed_forward.w2" in compression_state(model).quantization["excluded"]
    with pytest.raises(PrunusError, match="has 2 blocks"):
        quantize_pass(tiny_model, ctx, scheme="fp8-weight-only", exclude=["layers.-3"])


def test_quantizing_a_tied_head_unties_it(tmp_path, ctx):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(tie_embeddings=True))
    model.init_weights()
    ref = model(torch.arange(10)[None])
    model = quantize_pass(model, ctx, scheme="int8-weight-only", exclude=[])
    assert isinstance(model.output, QuantizedLinear) and model.tok_embeddings.weight.dtype == torch.float32
    assert model.config.tie_embeddings is False and compression_state(model).quantization["untied_output"] is True
    assert rel_err(model(torch.arange(10)[None]), ref) < 0.02
    loaded = load_model(save_model(model, tmp_path / "q", stage="compress"))
    assert torch.equal(loaded(torch.arange(10)[None]), model(torch.arange(10)[None]))


def test_smoothquant_is_equivalent_in_float(tiny_model, ctx):
    tokens = torch.randint(0, 256, (2, 24))
    ref = tiny_model(tokens)
    norm_before = tiny_model.layers["0"].attention_norm.weight.clone()
    model = smoothquant_pass(tiny_model, ctx, alpha=0.5, n_calib=2)
    assert not torch.allclose(model.layers["0"].attention_norm.weight, norm_before)  # scales were folded in
    torch.testing.assert_close(model(tokens), ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(PrunusError, match="alpha=1.5 must be a number in"):
        smoothquant_pass(model, ctx, alpha=1.5)
    quantize_pass(model, ctx, scheme="w8a8-static", n_calib=2)
    with pytest.raises(PrunusError, match="put smoothquant before quantize"):
        smoothquant_pass(model, ctx)


@pytest.mark.parametrize("text,needle", [
    ("passes:\n  - quantise: {scheme: int8-weight-only}\n", "unknown pass 'quantise'"),
    ("passes:\n  - quantize: {scheme: int8-weight-only, bits: 4}\n", "has no argument 'bits'"),
    ("passes:\n  - quantize: {scheme: int4}\n", "quantize.scheme='int4' is not valid"),
    ("passes:\n  - quantize: {granularity: per_channel}\n", "needs scheme"),
    ("passes:\n  - smoothquant: {alpha: 2}\n", "smoothquant.alpha=2 is not valid"),
    ("passes:\n  - quantize: [1, 2]\n", "must be a mapping"),
    ("passes: []\n", "non-empty 'passes:' list"),
    ("passes:\n  - quantize: {scheme: int8-weight-only}\nsteps: 3\n", "unknown key(s) steps"),
    ("passes: [quantize: {\n", "not valid YAML"),
])
def test_recipe_mistakes_are_one_clear_error(text, needle):
    with pytest.raises(PrunusError) as e:
        parse_recipe(text, source="r.yaml")
    assert needle in str(e.value) and str(e.value).startswith("r.yaml") and "\n" not in str(e.value)


@pytest.mark.parametrize("path", sorted(RECIPES_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_parse(path):
    passes, text = load_recipe(path.stem)  # by name, as --recipe accepts it
    assert passes and text == path.read_text()
    assert all(name in PASSES for name, _ in passes)


def test_a_pass_that_draws_progress_says_so_in_the_registry():
    import inspect

    from prunus.compress.recipe import get_pass

    for name, entry in PASSES.items():  # the runner hands progress=False to exactly these when it shows none
        assert entry.shows_progress == ("progress" in inspect.signature(get_pass(name)).parameters), name
    assert PASSES["distill"].shows_progress


def test_shortcuts_map_onto_passes():
    assert shortcut_passes(quantize="fp8-w8a8") == [("quantize", {"scheme": "fp8-w8a8"})]
    assert shortcut_passes(prune="wanda:0.3") == [("prune", {"method": "wanda", "sparsity": 0.3})]
    assert shortcut_passes(prune="2:4") == [("prune", {"method": "2:4"})]
    assert shortcut_passes(prune="heads:0.25") == [("prune_structured", {"target": "heads", "amount": 0.25})]
    assert shortcut_passes(prune="blocks:1", quantize="int8-weight-only") == [
        ("prune_structured", {"target": "blocks", "amount": 1}), ("quantize", {"scheme": "int8-weight-only"})]
    with pytest.raises(PrunusError, match="--prune wanda:half: 'half' is not a number"):
        shortcut_passes(prune="wanda:half")
    with pytest.raises(PrunusError, match="--quantize: quantize.scheme='int3' is not valid"):
        shortcut_passes(quantize="int3")


def test_max_quality_drop_stops_the_api_before_writing(tmp_path, trained_run, text_file):
    crush = [("quantize", {"scheme": "w8a8-static", "granularity": "per_tensor", "calibration": "percentile",
                           "percentile": 1.0, "n_calib": 1})]
    with pytest.raises(QualityDropError, match=r"bits per byte rose .*% over the input \(.* -> .*\), above "
                                               "--max-quality-drop 1%"):
        compress(trained_run / "model", crush, tmp_path / "out", data=str(text_file), max_quality_drop=0.01, eval_tokens=1024,
                 latency=False, progress=False)
    with pytest.raises(PrunusError, match="--trust-factory: not taken by a transformer"):
        compress(trained_run / "model", crush, tmp_path / "out", data=str(text_file), trust_factory=True)
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.txt"]  # no output, no temp dir


def test_cli_compress_end_to_end(tmp_path, trained_run, text_file, assert_user_error):
    model_dir = trained_run / "model"
    out = tmp_path / "int8"
    common = ["--data", text_file, "--eval-tokens", 2048, "--max-corpus-bytes", 200000]
    r = run("compress", model_dir, "--quantize", "int8-weight-only", "--out", out, *common)
    assert r.exit_code == 0, r.output
    assert "quantize(scheme=int8-weight-only)" in r.stdout and "bits/byte" in r.stdout
    manifest = verify_model_dir(out)  # every file, report and recipe included, matches its hash
    assert {"recipe.yaml", "report.json", "report.md", "report.png"} <= set(manifest["files"])
    assert manifest["stage"] == "compress" and manifest["parent"]["path"] == str(model_dir.resolve())
    report = json.loads((out / "report.json").read_text())
    assert [row["pass"] for row in report["rows"]] == ["input", "quantize(scheme=int8-weight-only)"]
    base, row = report["rows"]
    assert row["bytes"] == (out / "model.safetensors").stat().st_size < 0.5 * base["bytes"]  # embeddings stay float
    assert abs(row["bpb_change"]) < 0.01 and row["agreement"] > 0.8 and row["decode_ms"] > 0
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert parse_recipe((out / "recipe.yaml").read_text()) == [("quantize", {"scheme": "int8-weight-only"})]
    # the written model is exactly the in-memory pass applied to the input
    ctx = build_context(model_dir, data=str(text_file), max_corpus_bytes=200000)
    expected = quantize_pass(load_model(model_dir), ctx, scheme="int8-weight-only")
    tokens = torch.randint(0, 256, (1, 16))
    assert torch.equal(load_model(out)(tokens), expected(tokens))

    # a pass that loses too much: exit 1, one line, nothing written
    crush = tmp_path / "crush.yaml"
    crush.write_text("passes:\n  - quantize: {scheme: w8a8-static, granularity: per_tensor, calibration: percentile, "
                     "percentile: 1.0, n_calib: 1}\n")
    r = run("compress", model_dir, "--recipe", crush, "--out", tmp_path / "bad", "--max-quality-drop", 0.01,
            "--no-latency", *common)
    last = r.stderr.strip().splitlines()[-1]  # after the progress lines, one error line
    assert r.exit_code == 1 and last.startswith("Error: ") and "above --max-quality-drop 1%" in last
    assert not (tmp_path / "bad").exists()

    # user mistakes: exit 2, one line, nothing written
    for args, needles in [
        (["--quantize", "int4"], ["int4", "is not valid"]),
        (["--recipe", tmp_path / "nope.yaml"], ["nope.yaml", "no such file"]),
        (["--recipe", "int8-weight-only", "--quantize", "fp8-w8a8"], ["cannot be combined"]),
        ([], ["nothing to do"]),
        (["--prune", "sparse:0.5"], ["--prune sparse:0.5", "unknown method"]),
    ]:
        assert_user_error(run("compress", model_dir, *args, "--out", tmp_path / "o", *common), *needles)
        assert not (tmp_path / "o").exists()
    assert_user_error(run("compress", tmp_path / "missing", "--quantize", "int8-weight-only", "--out", tmp_path / "o",
                          *common), "missing", "no such model dir")
    assert_user_error(run("compress", model_dir, "--quantize", "int8-weight-only", "--out", out, *common),
                      "already exists", "--overwrite")
    assert not (tmp_path / "o").exists()


def test_runner_chains_pruning_distillation_and_quantization(tmp_path, trained_run, text_file):
    """Every registered pass through the runner; the result reloads and runs."""
    passes = [("prune_structured", {"target": "heads", "amount": 0.5, "n_calib": 1}),
              ("distill", {"steps": 2, "batch_size": 2, "seq_len": 32}),
              ("prune", {"method": "wanda", "sparsity": 0.5, "n_calib": 1}),
              ("quantize", {"scheme": "int8-weight-only"})]
    out = tmp_path / "chain"
    report = compress(trained_run / "model", passes, out, data=str(text_file), eval_tokens=1024, seq_len=48,
                      max_corpus_bytes=200000, latency=False, progress=False)
    rows = report["rows"]
    # every row scored the same slice, in the windows asked for; what passes did is noted, phases timed
    n = rows[0]["val_tokens"]
    assert report["seq_len"] == 48 and 0 < n <= 1024 and n % 48 == 0 and all(r["val_tokens"] == n for r in rows)
    assert rows[1]["notes"][0].startswith("removed 2 of 4 attention heads in every block (50.0%)")
    assert rows[2]["notes"] == ["distilled 2 steps x 2 rows x 32 tokens (128 training tokens)"]
    assert set(rows[0]["seconds"]) == {"eval", "greedy", "size", "latency"} and len(report["seconds"]["passes"]) == 4
    assert report["seconds"]["total"] >= report["seconds"]["before_save"] > 0
    md = (out / "report.md").read_text()
    assert f"{n:,} held-out tokens" in md and "windows of 48 tokens" in md and "row 1 (prune_structured" in md
    assert [r["pass"].split("(")[0] for r in rows] == ["input", "prune_structured", "distill", "prune", "quantize"]
    assert rows[1]["params"] < rows[0]["params"] and rows[3]["nonzero_params"] < 0.7 * rows[2]["nonzero_params"]
    assert rows[4]["bytes"] < rows[3]["bytes"]
    model = load_model(out)
    assert model.config.n_heads == get_preset("tiny").n_heads // 2
    assert [p["name"] for p in compression_state(model).passes] == [name for name, _ in passes]
    assert compression_state(model).sparsity and compression_state(model).quantization
    tokens = torch.randint(0, 256, (1, 12))
    assert torch.isfinite(model(tokens)).all()
