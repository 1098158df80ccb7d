"""Compression of generic modules: structured channel pruning (torch-pruning) of a small ResNet-style CNN
with BatchNorm and a residual addition, the pruned model dir rebuilt from its factory and recorded shapes (no
pickles), the classification report, the CLI with a shipped recipe, and the user-facing errors."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from torch import nn

from prunus.artifacts.errors import PrunusError
from prunus.cli.main import cli
from prunus.compress import compress
from prunus.models.module_dir import load_module, save_module
from prunus.models.module_factory import build_module

pytest.importorskip("torch_pruning")

DATA = "synthetic:classification?n=64&shape=3x8x8&classes=4&val=32"
SPEC = "test_module_compress:resnet"


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def resnet(channels=3, width=16, classes=4):
    return nn.Sequential(nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                         Block(width), Block(width), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes))


def student(width=4):
    return resnet(width=width)


@pytest.fixture
def cnn_dir(tmp_path):
    torch.manual_seed(0)
    model = build_module(SPEC, {})
    for m in model.modules():  # distinct running statistics, so a wrong channel mapping shows
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    return save_module(model, tmp_path / "cnn", stage="train", task="classification",
                       input={"shape": [3, 8, 8], "dtype": "float32"})


def test_prune_channels_halves_the_cnn_and_round_trips(cnn_dir, tmp_path):
    passes = [("prune_channels", {"amount": 0.5, "finetune_steps": 2, "batch_size": 16})]
    report = compress(cnn_dir, passes, tmp_path / "out", data=DATA, trust_factory=True, latency=False)
    before, after = report["rows"]
    assert after["params"] < 0.5 * before["params"]
    assert 0 <= after["val_accuracy"] <= 1 and "val_accuracy" in before and "accuracy_change" in after
    assert any("fine-tuned 2 steps" in n for n in after["notes"])
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert config["pruned_shapes"]["0.weight"] == [8, 3, 3, 3]
    assert config["pruned_shapes"]["7.weight"] == [4, 8]  # the classifier keeps its 4 classes
    loaded = load_module(tmp_path / "out", trust_factory=True)
    with safe_open(tmp_path / "out/model.safetensors", "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in stored.items())
    assert loaded[0].out_channels == 8 and loaded[1].num_features == 8 and loaded[7].in_features == 8
    x = torch.randn(5, 3, 8, 8)
    assert loaded(x).shape == (5, 4)
    from prunus.compress.module_compress import ModuleContext, evaluate
    from prunus.data.synthetic import synthetic_datasets
    from prunus.models.tasks import get_task

    ctx = ModuleContext(tmp_path / "out", config, get_task("classification"), *synthetic_datasets(DATA))
    assert evaluate(loaded, ctx) == {k: after[k] for k in ("val_loss", "val_samples", "val_accuracy")}
    md = (tmp_path / "out/report.md").read_text()
    assert "top-1 accuracy" in md and "bits" not in md
    assert (tmp_path / "out/report.png").read_bytes()[:4] == b"\x89PNG"


def test_prune_by_flops_reaches_the_target(cnn_dir, tmp_path):
    report = compress(cnn_dir, [("prune_channels", {"amount": 0.4, "by": "flops", "importance": "group_norm"})],
                      tmp_path / "out", data=DATA, trust_factory=True, latency=False)
    assert report["rows"][1]["params"] < report["rows"][0]["params"]
    note = report["rows"][1]["notes"][0]
    flops_before, flops_after = (int(s.replace(",", "")) for s in note.split("FLOPs ")[1].split(" -> "))
    assert flops_after <= 0.6 * flops_before


def test_cli_compress_with_a_recipe(cnn_dir, tmp_path):
    from prunus.compress.recipe import RECIPES_DIR

    out, recipe = tmp_path / "cli-out", tmp_path / "r.yaml"  # the shipped recipe, with a shorter fine-tune
    recipe.write_text((RECIPES_DIR / "prune-channels-50.yaml").read_text().replace("finetune_steps: 50",
                                                                                   "finetune_steps: 2"))
    res = CliRunner().invoke(cli, ["compress", str(cnn_dir), "--recipe", str(recipe), "--out", str(out),
                                   "--data", DATA, "--trust-factory", "--no-latency"])
    assert res.exit_code == 0, res.output
    assert "top-1 accuracy" in res.output and (out / "recipe.yaml").is_file()
    assert load_module(out, trust_factory=True)(torch.randn(2, 3, 8, 8)).shape == (2, 4)


def test_untrusted_and_missing_data_are_one_line(cnn_dir, tmp_path):
    res = CliRunner().invoke(cli, ["compress", str(cnn_dir), "--recipe", "prune-channels-50", "--out",
                                   str(tmp_path / "o"), "--data", DATA])
    assert res.exit_code == 2 and "trust" in res.output and not (tmp_path / "o").exists()
    with pytest.raises(PrunusError, match="pass --data"):
        compress(cnn_dir, [("prune_channels", {})], tmp_path / "o", data=None, trust_factory=True)
    with pytest.raises(PrunusError, match="does not apply to a generic module"):
        compress(cnn_dir, [("prune", {"method": "magnitude"})], tmp_path / "o", data=DATA, trust_factory=True)
    # the options of a language model's run are refused, never ignored (one runner, the kind says what it takes)
    for flags in (["--max-quality-drop", "0.1"], ["--max-quality-drop", "0"], ["--seq-len", "64"], ["--eval-tokens", "512"],
                  ["--max-corpus-bytes", "1000"]):
        res = CliRunner().invoke(cli, ["compress", str(cnn_dir), "--recipe", "prune-channels-50", "--out",
                                       str(tmp_path / "o"), "--data", DATA, "--trust-factory", *flags])
        assert res.exit_code == 2 and f"{flags[0]}: not taken by a generic module" in res.output, res.output
    for flags in (["--graph", "torch"], ["--external-data"]):  # a language model's export options, refused too
        res = CliRunner().invoke(cli, ["export", str(cnn_dir), "--out", str(tmp_path / "o"), "--trust-factory", *flags])
        assert res.exit_code == 2 and f"{flags[0]}: not taken by a generic module's export" in res.output, res.output
    assert not (tmp_path / "o").exists()


def test_bad_pruned_shapes_is_one_line(cnn_dir):
    config = json.loads((cnn_dir / "config.json").read_text())
    config["pruned_shapes"] = {"9.weight": [2, 2]}
    (cnn_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(PrunusError, match=r"pruned_shapes names '9.weight'"):
        load_module(cnn_dir, trust_factory=True)
    config["pruned_shapes"] = {"0.weight": "big"}
    (cnn_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(PrunusError, match=r"pruned_shapes\['0.weight'\]"):
        load_module(cnn_dir, trust_factory=True)


def test_missing_torch_pruning_names_the_extra(monkeypatch):
    import sys

    from prunus.compress.module_prune import torch_pruning

    monkeypatch.setitem(sys.modules, "torch_pruning", None)
    with pytest.raises(PrunusError, match=r"prunus\[prune\]"):
        torch_pruning()


@pytest.mark.slow  # an ONNX export (torch.onnx.export)
def test_export_int8_static_qdq(cnn_dir, tmp_path):
    import onnx

    out = tmp_path / "int8"
    res = CliRunner().invoke(cli, ["export", str(cnn_dir), "--format", "onnx", "--precision", "int8", "--out",
                                   str(out), "--data", DATA, "--trust-factory"])
    assert res.exit_code == 0, res.output
    parity = json.loads((out / "parity.json").read_text())
    assert parity["precision"] == "int8" and parity["passed"] and parity["top1_agreement"] >= 0.9
    assert parity["int8_weight_share"] > 0.5 and parity["graph_bytes"] < parity["graph_bytes_fp32"]
    graph = onnx.load(str(out / "model.onnx"))
    ops = {n.op_type for n in graph.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops and "BatchNormalization" not in ops
    weights = [onnx.numpy_helper.to_array(t) for t in graph.graph.initializer if t.data_type == onnx.TensorProto.INT8]
    # 7-bit weights: uint8 x int8 pairs never saturate the int16 sums of CPUs without VNNI
    assert weights and all(int(abs(w.astype(int)).max()) <= 64 for w in weights)
    assert json.loads((out / "config.json").read_text())["export"]["precision"] == "int8"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.onnx", "parity.json", "prunus.json"]


def test_int8_calibration_spreads_over_a_class_ordered_split(tmp_path, monkeypatch):
    import numpy as np

    from prunus.export import module_int8

    for c in range(3):  # an image folder lists its samples class by class; each image holds its class index
        (tmp_path / "data" / str(c)).mkdir(parents=True)
        for i in range(20):
            np.save(tmp_path / "data" / str(c) / f"{i:02d}.npy", np.full((1, 2, 2), c, np.float32))
    assert module_int8.spread_indices(10, 4) == [0, 3, 6, 9] and module_int8.spread_indices(3, 8) == [0, 1, 2]
    assert module_int8.spread_indices(10, 1) == [0]
    monkeypatch.setattr(module_int8, "CALIB_SAMPLES", 6)
    calib, what = module_int8.calibration_inputs({}, str(tmp_path / "data"), tmp_path)
    assert "6 samples of" in what and calib.shape == (6, 1, 2, 2) and set(calib[:, 0, 0, 0].tolist()) == {0.0, 1.0, 2.0}


def test_distill_module_into_a_smaller_student(cnn_dir, tmp_path):
    passes = [("distill_module", {"student": SPEC, "student_args": {"width": 4}, "steps": 8, "batch_size": 16,
                                  "temperature": 2.0, "alpha": 0.5})]
    report = compress(cnn_dir, passes, tmp_path / "out", data=DATA, trust_factory=True, latency=False)
    teacher_row, student_row = report["rows"]
    assert student_row["params"] < teacher_row["params"] / 3 and 0 <= student_row["val_accuracy"] <= 1
    assert "distilled 8 steps" in student_row["notes"][0]
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert config["args"] == {"width": 4} and "pruned_shapes" not in config and config["task"] == "classification"
    assert load_module(tmp_path / "out", trust_factory=True)(torch.randn(3, 3, 8, 8)).shape == (3, 4)
    other = [("distill_module", {**passes[0][1], "student": "test_module_compress:student"})]
    with pytest.raises(PrunusError, match="recipe: distill_module.student names the factory test_module_compress:student; .* --trust-factory"):
        compress(cnn_dir, other, tmp_path / "o2", data=DATA, trust_factory=[SPEC])  # the teacher's only
    assert not (tmp_path / "o2").exists()


def test_kd_loss_is_cross_entropy_at_alpha_zero_and_zero_when_matching():
    from prunus.compress.module_distill import kd_loss

    logits, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 3, 0])
    packed = torch.cat([logits, y[:, None].float(), torch.full((5, 1), 3.0), torch.zeros(5, 1)], 1)
    assert torch.allclose(kd_loss(logits, packed), torch.nn.functional.cross_entropy(logits, y))
    packed[:, -1] = 1.0
    assert float(kd_loss(logits, packed)) == pytest.approx(0.0, abs=1e-6)
