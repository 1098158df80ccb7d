"""Compression of generic modules beyond CNNs: a ViT-like model (nn.MultiheadAttention), an nn.TransformerEncoder
over tokens, GRU and LSTM classifiers and an MLP regressor. Each goes through prune (or its one-line refusal),
eval, export and predict, and no pass leaves a dir that does not reload; int8 export states its calibration,
the share of parameters it quantized and a limit for regression outputs."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from prunus.artifacts.errors import PrunusError
from prunus.cli.main import cli
from prunus.compress import compress
from prunus.models.module_dir import load_module, save_module
from prunus.models.module_factory import build_module

pytest.importorskip("torch_pruning")

IMAGES = "synthetic:classification?n=48&shape=3x8x8&classes=4&val=24"
SEQS = "synthetic:classification?n=48&shape=5x8&classes=3&val=24"
REGRESSION = "synthetic:regression?n=48&shape=6&outputs=1&val=24"
TOKENS = "tokens:test"  # served by the token_data fixture
PRUNE = [("prune_channels", {"amount": 0.5})]


class ViT(nn.Module):
    def __init__(self, width=16, heads=4, classes=4):
        super().__init__()
        self.patch, self.norm = nn.Conv2d(3, width, 4, 4), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        t = self.patch(x).flatten(2).transpose(1, 2)
        h = self.norm(t)
        t = t + self.attn(h, h, h, need_weights=False)[0]
        return self.head((t + self.mlp(t)).mean(1))


class TokenEncoder(nn.Module):
    def __init__(self, vocab=20, width=16, heads=2, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True)
        self.enc, self.head = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False), nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)).mean(1))


class Recurrent(nn.Module):
    def __init__(self, kind="GRU", hidden=16, classes=3):
        super().__init__()
        self.rnn, self.head = getattr(nn, kind)(8, hidden, batch_first=True), nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def vit():
    return ViT()


def token_encoder():
    return TokenEncoder()


def recurrent(kind="GRU"):
    return Recurrent(kind)


def mlp():
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))


def linear():
    return nn.Sequential(nn.Linear(6, 1))  # its one layer is the output: nothing to cut


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, offset):
        self.n, self.offset = n, offset

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.randint(0, 20, (6,), generator=torch.Generator().manual_seed(self.offset + i))
        return x, x[0] % 3


@pytest.fixture
def token_data(monkeypatch):
    """``--data tokens:test``: sequences of 6 token ids and a class, beside prunus's own data sources."""
    import prunus.data.module_datasets as datasets

    real = datasets.module_datasets

    def module_datasets(spec, *args, **kwargs):
        return (Tokens(48, 0), Tokens(24, 1000)) if spec == TOKENS else real(spec, *args, **kwargs)

    monkeypatch.setattr(datasets, "module_datasets", module_datasets)
    import prunus.train_parallel.held_out_eval as module_eval

    if hasattr(module_eval, "module_datasets"):
        monkeypatch.setattr(module_eval, "module_datasets", module_datasets)


def _dir(tmp_path, name, args=None, task="classification", input=None):
    torch.manual_seed(0)
    model = build_module(f"test_module_prune_kinds:{name}", args or {})
    return save_module(model, tmp_path / name, stage="train", task=task, input=input)


def _cli(*args):
    res = CliRunner().invoke(cli, [str(a) for a in args], env={"COLUMNS": "200"})  # tables as wide as their rows
    return res.exit_code, res.output


def _through_the_cli(src, tmp_path, data, batch):
    """prune -> eval -> export -> predict of ``src``; the pruned dir's parameters."""
    from prunus.serve import Engine

    out, exp = tmp_path / "pruned", tmp_path / "exp"
    code, text = _cli("compress", src, "--recipe", tmp_path / "r.yaml", "--out", out, "--data", data,
                      "--trust-factory", "--no-latency")
    assert code == 0, text
    code, text = _cli("eval", out, "--data", data, "--trust-factory")
    assert code == 0, text
    code, text = _cli("export", out, "--out", exp, "--data", data, "--trust-factory")
    assert code == 0, text
    want = load_module(out, trust_factory=True)(batch)
    with Engine.load(exp) as engine:
        got = engine.predict(batch.numpy())
    assert abs(torch.from_numpy(got) - want).max() < 1e-3
    return sum(p.numel() for p in load_module(out, trust_factory=True).parameters())


@pytest.mark.slow
@pytest.mark.parametrize("name,data,shape", [("vit", IMAGES, (3, 3, 8, 8)), ("token_encoder", TOKENS, None)])
def test_attention_models_prune_eval_export_predict(name, data, shape, tmp_path, token_data):
    (tmp_path / "r.yaml").write_text("passes:\n  - prune_channels: {amount: 0.5}\n")
    src = _dir(tmp_path, name, input={"shape": [3, 8, 8], "dtype": "float32"} if shape else
               {"shape": [6], "dtype": "int64", "high": 20})
    batch = torch.randn(shape) if shape else torch.randint(0, 20, (3, 6))
    before = sum(p.numel() for p in load_module(src, trust_factory=True).parameters())
    assert _through_the_cli(src, tmp_path, data, batch) < 0.6 * before
    config = json.loads((tmp_path / "pruned/config.json").read_text())
    mha = next(m for m in load_module(tmp_path / "pruned", trust_factory=True).modules()
               if isinstance(m, nn.MultiheadAttention))
    assert mha.embed_dim == 8 and mha.head_dim * mha.num_heads == 8 and mha.kdim == mha.vdim == 8
    assert any("in_proj_weight" in k for k in config["pruned_shapes"])


def test_the_vit_reloads_with_its_attention_sizes(tmp_path):
    src = _dir(tmp_path, "vit", input={"shape": [3, 8, 8], "dtype": "float32"})
    report = compress(src, PRUNE, tmp_path / "out", data=IMAGES, trust_factory=True, latency=False)
    loaded = load_module(tmp_path / "out", trust_factory=True)
    assert (loaded.attn.embed_dim, loaded.attn.num_heads, loaded.attn.head_dim) == (8, 4, 2)
    assert report["rows"][1]["params"] == sum(p.numel() for p in loaded.parameters())
    assert loaded(torch.randn(2, 3, 8, 8)).shape == (2, 4)


@pytest.mark.parametrize("kind", ["GRU", "LSTM", "RNN"])
def test_recurrent_layers_are_refused_in_one_line(kind, tmp_path):
    src = _dir(tmp_path, "recurrent", {"kind": kind}, input={"shape": [5, 8], "dtype": "float32"})
    code, text = _cli("compress", src, "--recipe", "prune-channels-50", "--out", tmp_path / "o", "--data", SEQS,
                      "--trust-factory", "--no-latency")
    assert code == 2 and f"nn.{kind}" in text and "Traceback" not in text, text
    lines = text.strip().splitlines()  # the pass's progress line, then the error: one line, the last
    assert [line for line in lines if line.startswith("Error")] == lines[-1:] and not (tmp_path / "o").exists()


def test_a_pass_that_cuts_nothing_writes_nothing(tmp_path):
    src = _dir(tmp_path, "linear", task="regression", input={"shape": [6], "dtype": "float32"})
    with pytest.raises(PrunusError, match="found no channel .* nothing was written"):
        compress(src, PRUNE, tmp_path / "o", data=REGRESSION, trust_factory=True,
                 latency=False)
    assert not (tmp_path / "o").exists()
    report = compress(src, [("prune_channels", {"amount": 0.5, "allow_unchanged": True})], tmp_path / "o",
                      data=REGRESSION, trust_factory=True, latency=False)
    assert report["rows"][0]["params"] == report["rows"][1]["params"] and (tmp_path / "o/config.json").is_file()


def test_the_mlp_regressor_prunes_and_reloads(tmp_path):
    src = _dir(tmp_path, "mlp", task="regression", input={"shape": [6], "dtype": "float32"})
    report = compress(src, PRUNE, tmp_path / "o", data=REGRESSION, trust_factory=True, latency=False)
    assert report["rows"][1]["params"] < report["rows"][0]["params"]
    assert load_module(tmp_path / "o", trust_factory=True)[0].out_features == 16


def test_a_dir_that_does_not_reload_is_never_written(tmp_path, monkeypatch):
    """A reshape that forgets a layer's sizes: the staged dir fails its forward, --out is never created."""
    import prunus.models.module_reshape as reshape

    src = _dir(tmp_path, "vit", input={"shape": [3, 8, 8], "dtype": "float32"})
    monkeypatch.setattr(reshape, "_sync_attention", lambda mha, where, fix: None)
    with pytest.raises(PrunusError, match="nothing was written"):
        compress(src, PRUNE, tmp_path / "o", data=IMAGES, trust_factory=True, latency=False)
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".o")]


# --- int8 export: its method, its share, its calibration, a regressor's limit -------------------------------


def _export(src, tmp_path, *extra):
    return _cli("export", src, "--out", tmp_path / "exp", "--precision", "int8", "--trust-factory", *extra)


@pytest.mark.slow  # ONNX exports and quantization
def test_int8_of_a_gru_says_what_stayed_float(tmp_path):
    src = _dir(tmp_path, "recurrent", {"kind": "GRU"}, input={"shape": [5, 8], "dtype": "float32"})
    code, text = _export(src, tmp_path, "--data", SEQS)
    parity = json.loads((tmp_path / "exp/parity.json").read_text()) if code == 0 else {}
    assert code == 0 and parity["int8_method"] == "dynamic" and parity["calibration"].startswith("none"), text
    assert parity["int8_param_share"] < 0.1 and parity["float_ops"] == ["GRU"]
    assert "int8 share of parameters" in text and "GRU" in text


@pytest.mark.slow  # ONNX exports and quantization
def test_int8_of_an_lstm_and_an_mlp_is_dynamic_and_mostly_int8(tmp_path):
    src = _dir(tmp_path, "recurrent", {"kind": "LSTM"}, input={"shape": [5, 8], "dtype": "float32"})
    code, text = _export(src, tmp_path, "--data", SEQS)
    assert code == 0, text
    parity = json.loads((tmp_path / "exp/parity.json").read_text())
    assert parity["int8_method"] == "dynamic" and parity["int8_param_share"] > 0.8 and parity["float_ops"] == []


@pytest.mark.slow  # ONNX exports and quantization
def test_int8_regression_parity_has_a_limit(tmp_path, monkeypatch):
    from prunus.export import module_export

    src = _dir(tmp_path, "mlp", task="regression", input={"shape": [6], "dtype": "float32"})
    code, text = _export(src, tmp_path, "--data", REGRESSION)
    assert code == 0, text
    parity = json.loads((tmp_path / "exp/parity.json").read_text())
    assert parity["output_rel_mse"] <= 0.02 and "mse_increase" in parity and "top1_agreement" not in parity
    assert set(parity["tolerances"]) == {"output_rel_mse", "mse_increase"}
    tight = {**module_export.MODULE_TOLERANCES["int8"], "output_rel_mse": 1e-9}
    monkeypatch.setitem(module_export.MODULE_TOLERANCES, "int8", tight)
    code, text = _export(src, tmp_path / "b", "--data", REGRESSION)
    assert code == 1 and "FAIL" in text and not (tmp_path / "b/exp").exists(), text


@pytest.mark.slow  # ONNX exports and quantization
def test_static_int8_calibrates_on_random_inputs_only_when_asked(tmp_path):
    src = _dir(tmp_path, "vit", input={"shape": [3, 8, 8], "dtype": "float32"})
    code, text = _export(src, tmp_path)
    assert code == 2 and "--data random" in text and len(text.strip().splitlines()) == 1, text
    assert not (tmp_path / "exp").exists()
    code, text = _export(src, tmp_path, "--data", "random", "--no-verify")
    assert code == 0, text
    parity = json.loads((tmp_path / "exp/parity.json").read_text())
    assert parity["int8_method"] == "static" and parity["calibration"].startswith("synthetic")
    assert parity["inputs"].startswith("synthetic") and "synthetic" in text


@pytest.mark.slow  # an ONNX export
def test_a_token_model_without_data_exports_or_says_why_in_one_line(tmp_path):
    src = _dir(tmp_path, "token_encoder", input={"shape": [6], "dtype": "int64", "high": 20})
    code, text = _export(src, tmp_path)
    assert code == 0 and "synthetic" in text, text  # dynamic int8: no calibration; probes of ids below high
    bad = _dir(tmp_path / "f", "token_encoder", input={"shape": [6], "dtype": "float32"})
    code, text = _export(bad, tmp_path / "f")
    assert code == 2 and "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert "pass --data" in text and not (tmp_path / "f/exp").exists()


def test_a_cut_that_breaks_the_module_is_one_line(tmp_path, monkeypatch):
    import torch_pruning as tp

    def step(self):  # a pruner that leaves a layer inconsistent with the next
        self.model[0].weight = nn.Parameter(torch.zeros(8, 6))

    monkeypatch.setattr(tp.pruner.MetaPruner, "step", step)
    src = _dir(tmp_path, "mlp", task="regression", input={"shape": [6], "dtype": "float32"})
    with pytest.raises(PrunusError, match=r"^prune_channels: layer 0 \(Linear\) fails after torch-pruning's cut"):
        compress(src, PRUNE, tmp_path / "o", data=REGRESSION, trust_factory=True, latency=False)
    assert not (tmp_path / "o").exists()
