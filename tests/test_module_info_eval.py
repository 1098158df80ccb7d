"""prunus info and prunus eval on a generic module dir (config.json kind "module"): the factory, task, input,
parameters and lineage shown without importing the factory; the task's figures computed as the trainer does."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from prunus.cli.main import cli
from prunus.data.synthetic import synthetic_datasets
from prunus.models.model_dir import write_manifest
from prunus.models.module_dir import save_module
from prunus.models.module_factory import build_module
from prunus.models.tasks import get_task
from prunus.train_parallel.module_trainer import score_module

DATA = "synthetic:classification?n=16&shape=8&classes=3&val=24"
REG = "synthetic:regression?n=16&shape=8&outputs=3&val=20"


def _dir(tmp_path, name="m", task="classification", parent=None, marker=None):
    torch.manual_seed(0)
    model = build_module("test_any_model:two_linear", {"hidden": 5})
    path = save_module(model, tmp_path / name, stage="train" if parent is None else "compress", task=task,
                       input={"shape": [8], "dtype": "float32"}, parent=parent, command=f"prunus make {name}")
    if marker is not None:  # a factory whose import would leave a marker: info must not import it
        config = json.loads((path / "config.json").read_text())
        config.update(factory="os:system", args={"command": f"touch {marker}"})
        (path / "config.json").write_text(json.dumps(config))
        write_manifest(path, stage="train", parent_info=None, command="x", metrics={"params": 63})
    return path, model


def test_info_shows_factory_task_params_input_and_lineage(tmp_path):
    parent, model = _dir(tmp_path, "parent")
    child, _ = _dir(tmp_path, "child", parent=parent)
    result = CliRunner().invoke(cli, ["info", str(child)], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    out = result.output
    params = sum(p.numel() for p in model.parameters())  # 8*5+5 + 5*3+3 = 63
    assert params == 63 and "63" in out
    assert "test_any_model:two_linear" in out and '{"hidden": 5}' in out and "classification" in out
    assert "float32 [8]" in out
    assert "0: compress" in out and "1: train" in out and str(parent.resolve()) in out
    assert "prunus make parent" in out and "prunus make child" in out


def test_info_never_imports_the_factory(tmp_path):
    marker = tmp_path / "MARKER"
    path, _ = _dir(tmp_path, marker=marker)
    result = CliRunner().invoke(cli, ["info", str(path)], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "os:system" in result.output and not marker.exists()


def test_info_of_a_bad_module_dir_is_one_line(tmp_path, assert_user_error):
    path, _ = _dir(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["factory"] = "not a spec"
    (path / "config.json").write_text(json.dumps(config))
    assert_user_error(CliRunner().invoke(cli, ["info", str(path)]), "not a factory spec")


def test_eval_scores_as_the_trainer_does(tmp_path):
    path, model = _dir(tmp_path)
    _, val = synthetic_datasets(DATA)
    result = CliRunner().invoke(cli, ["eval", str(path), "--data", DATA, "--trust-factory", "--batch-size", "7"],
                                env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    metrics = json.loads((path / "prunus.json").read_text())["metrics"]
    xs = torch.stack([val[i][0] for i in range(len(val))])
    ys = torch.stack([val[i][1] for i in range(len(val))])
    with torch.no_grad():
        logits = model.eval()(xs)
    assert metrics["val_samples"] == 24
    assert metrics["val_accuracy"] == float((logits.argmax(-1) == ys).float().mean())
    assert abs(metrics["val_loss"] - float(torch.nn.functional.cross_entropy(logits, ys))) < 1e-6
    assert "top-1 accuracy" in result.output and f"{metrics['val_accuracy']:.4f}" in result.output
    ref = score_module(model, get_task("classification"), val, batch_size=24, max_samples=100)
    assert abs(ref["val_loss"] - metrics["val_loss"]) < 1e-6


def test_eval_regression_is_mse(tmp_path):
    torch.manual_seed(0)
    model = build_module("test_any_model:two_linear", {"hidden": 5})
    path = save_module(model, tmp_path / "r", stage="train", task="regression")
    _, val = synthetic_datasets(REG)
    result = CliRunner().invoke(cli, ["eval", str(path), "--data", REG, "--trust-factory", "--no-record"],
                                env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    xs = torch.stack([val[i][0] for i in range(len(val))])
    ys = torch.stack([val[i][1] for i in range(len(val))])
    with torch.no_grad():
        mse = float(((model.eval()(xs) - ys) ** 2).mean())
    assert "mean squared error" in result.output and f"{mse:.6g}" in result.output
    assert "accuracy" not in result.output
    assert "val_loss" not in json.loads((path / "prunus.json").read_text())["metrics"]


def test_eval_bad_inputs_are_one_line_exit_2(tmp_path, assert_user_error):
    path, _ = _dir(tmp_path)
    before = (path / "prunus.json").read_text()
    runner = CliRunner()
    for args, needle in [
        ([str(path), "--data", DATA], "names the factory test_any_model:two_linear; loading runs that code"),
        ([str(path), "--trust-factory"], "pass --data"),
        ([str(path), "--data", DATA, "--trust-factory", "--seq-len", "4"], "--seq-len applies to a transformer"),
        ([str(path), "--data", DATA, "--trust-factory", "--batch-size", "0"], "--batch-size 0 must be"),
        ([str(path), "--data", "synthetic:classification?n=16&shape=5&classes=3", "--trust-factory"],
         "do not fit the module"),
        ([str(path), "--data", str(tmp_path / "nowhere"), "--trust-factory"], "does not exist"),
    ]:
        assert_user_error(runner.invoke(cli, ["eval", *args]), needle)
    assert (path / "prunus.json").read_text() == before
