"""A generic module's run dir and export dir as first-class as a transformer's: prunus info of both, prunus train
--resume from the run dir alone, prunus eval of an ONNX export dir through ONNX Runtime, and the best
checkpoint kept in checkpoints/best beside the last (the model dir from it with --model-from best)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from prunus.cli.main import cli
from prunus.export.module_export import export_module
from prunus.models.module_dir import save_module
from prunus.models.module_factory import build_module

DATA = "synthetic:classification?n=64&shape=8&classes=3&val=32"
REG = "synthetic:regression?n=32&shape=8&outputs=3&val=20"
TRAIN = ["train", "--model", "test_any_model:two_linear", "--data", DATA, "--steps", "6", "--batch-size", "8",
         "--eval-every", "2", "--ckpt-every", "2", "--warmup-steps", "1", "--lr", "0.05"]
WIDE = {"COLUMNS": "400"}


def _run(*args):
    return CliRunner().invoke(cli, list(args), env=WIDE)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run dir of the two-Linear classifier stopped at step 4 of 6."""
    out = tmp_path_factory.mktemp("runs") / "run"
    result = _run(*TRAIN, "--stop-at", "4", "--out", str(out))
    assert result.exit_code == 0, result.output
    return out


def test_info_of_a_generic_run_dir_shows_settings_model_data_progress(stopped_run):
    result = _run("info", str(stopped_run))
    assert result.exit_code == 0, result.output
    out = result.output
    # the table's title wraps at the table's width where the run's path is long
    assert "generic module" in " ".join(out.split()) and "test_any_model:two_linear" in out and DATA in out
    assert "steps 2, 4" in out and "checkpoints/best" in out and "last val accuracy" in out
    best = json.loads((stopped_run / "checkpoints" / "best" / "best.json").read_text())
    assert best["metric"] == "val_accuracy" and best["step"] in (2, 4) and f"step {best['step']}" in out


def test_resume_from_the_run_dir_alone(stopped_run, tmp_path, assert_user_error):
    assert_user_error(_run("train", "--resume", "--out", str(stopped_run), "--lr", "0.1"),
                      "--lr 0.1 differs from the run", "0.05")
    assert_user_error(_run("train", "--resume", "--out", str(stopped_run), "--model", "test_any_model:resnet"),
                      "--model 'test_any_model:resnet' differs")
    assert not (stopped_run / "model").exists()
    result = _run("train", "--resume", "--out", str(stopped_run), "--lr", "0.05")  # a flag that agrees is fine
    assert result.exit_code == 0, result.output
    steps = [json.loads(line)["step"] for line in (stopped_run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6] and (stopped_run / "model" / "prunus.json").is_file()
    saved = json.loads((stopped_run / "checkpoints" / "step-6" / "train_state.json").read_text())
    assert saved["step"] == 6 and saved["samples"] == 48  # the step saved, not the one resumed from
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("best:") and "checkpoints/best" in last and "--model-from best" in last
    assert_user_error(_run("train", "--resume", "--out", str(tmp_path)), "holds no run")


def test_model_from_best_writes_the_best_checkpoint(tmp_path):
    out = tmp_path / "run"
    result = _run(*TRAIN, "--out", str(out), "--model-from", "best", "--no-progress")
    assert result.exit_code == 0, result.output
    best = json.loads((out / "checkpoints" / "best" / "best.json").read_text())
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    accuracies = [r["val_accuracy"] for r in evals if "val_accuracy" in r]
    assert best["value"] == max(accuracies) and best["step"] == 2 * (accuracies.index(max(accuracies)) + 1)
    kept = load_file(out / "checkpoints" / "best" / "model.safetensors")
    written = load_file(out / "model" / "model.safetensors")
    assert kept.keys() == written.keys() and all(torch.equal(kept[k], written[k]) for k in kept)
    metrics = json.loads((out / "model" / "prunus.json").read_text())["metrics"]
    assert metrics["best_step"] == best["step"] and metrics["val_accuracy"] == best["value"]
    assert "the model dir holds it" in result.output.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(the classifier's model dir, its fp32 and int8 export dirs)."""
    root = tmp_path_factory.mktemp("exports")
    torch.manual_seed(0)
    model = build_module("test_any_model:two_linear", {"hidden": 5})
    path = save_module(model, root / "m", stage="train", task="classification",
                       input={"shape": [8], "dtype": "float32"})
    fp32 = export_module(path, root / "fp32", trust_factory=True, data=DATA).path
    int8 = export_module(path, root / "int8", precision="int8", trust_factory=True, data=DATA).path
    return path, fp32, int8


def test_eval_of_an_export_dir_matches_its_model_dir(exports):
    path, fp32, int8 = exports
    ref = _run("eval", str(path), "--data", DATA, "--trust-factory", "--no-record")
    assert ref.exit_code == 0, ref.output
    result = _run("eval", str(fp32), "--data", DATA)
    assert result.exit_code == 0, result.output
    metrics = json.loads((fp32 / "prunus.json").read_text())["metrics"]
    assert metrics["val_samples"] == 32 and f"{metrics['val_accuracy']:.4f}" in ref.output
    assert "per class" in result.output and "confusion matrix" in result.output
    assert (fp32 / "confusion_matrix.png").is_file()
    quantized = _run("eval", str(int8), "--data", DATA, "--no-record")
    assert quantized.exit_code == 0 and "top-1 accuracy" in quantized.output, quantized.output
    info = _run("info", str(int8))
    assert info.exit_code == 0, info.output
    for needle in ("module export", "onnx int8", "parity against PyTorch", "top1_agreement", "stage", "export",
                   "model.onnx", "test_any_model:two_linear"):
        assert needle in info.output, needle


def test_eval_of_a_regression_export_is_mse_mae_r2(tmp_path):
    torch.manual_seed(0)
    model = build_module("test_any_model:two_linear", {"hidden": 5})
    path = save_module(model, tmp_path / "r", stage="train", task="regression",
                       input={"shape": [8], "dtype": "float32"})
    out = export_module(path, tmp_path / "r-onnx", trust_factory=True).path
    result = _run("eval", str(out), "--data", REG, "--no-record")
    assert result.exit_code == 0, result.output
    for needle in ("mean squared error", "mean absolute error", "R²"):
        assert needle in result.output
    assert "accuracy" not in result.output


def test_export_dir_bad_input_is_one_line(exports, tmp_path, assert_user_error):
    _, fp32, _ = exports
    assert_user_error(_run("eval", str(fp32)), "pass --data")
    assert_user_error(_run("eval", str(fp32), "--data", DATA, "--trust-factory"), "--trust-factory", "export dir")
    assert_user_error(_run("eval", str(fp32), "--data", "synthetic:classification?n=16&shape=5&classes=3"),
                      "do not fit the module")
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(fp32, bad)
    (bad / "model.onnx").write_bytes(b"not a graph")
    assert_user_error(_run("eval", str(bad), "--data", DATA), "model.onnx")
    assert_user_error(_run("info", str(bad)), "model.onnx")


def test_fewer_classes_than_a_class_folder_holds_is_one_line(tmp_path, assert_user_error):
    gen = np.random.default_rng(0)
    for c in range(10):
        (tmp_path / "data" / f"c{c}").mkdir(parents=True)
        for i in range(2):
            np.save(tmp_path / "data" / f"c{c}" / f"{i}.npy", gen.random((1, 2, 4)).astype(np.float32))
    result = _run("train", "--model", "test_any_model:two_linear", "--model-args", "classes=3", "--data",
                  str(tmp_path / "data"), "--steps", "1", "--batch-size", "2", "--out", str(tmp_path / "run"))
    assert_user_error(result, "10 classes, but the module scores 3")
    assert not (tmp_path / "run").exists()
