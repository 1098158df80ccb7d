"""Tables and arrays as a generic module's --data: CSV, Parquet, NPY and NPZ (token and float sequences) trained
from the CLI, scored by prunus eval (accuracy, the per-class report and the confusion matrix PNG; MSE / MAE / R²),
a separate test set scored whole, and every bad input as one line, exit 2, nothing written."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from torch import nn

from prunus.cli.main import cli
from prunus.data.module_datasets import module_datasets
from prunus.train_parallel.task_report import DPI, plot_inches

SIZES = ["--steps", "6", "--batch-size", "8", "--warmup-steps", "1", "--eval-every", "3", "--ckpt-every", "0",
         "--lr", "0.01", "--no-progress"]


# --- the models (factories named "test_tabular_data:...") ------------------------------------------------------
def mlp(inputs: int = 3, outputs: int = 2):
    return nn.Sequential(nn.Linear(inputs, 16), nn.ReLU(), nn.Linear(16, outputs))


class TokenMean(nn.Module):
    """Token sequences (N, T) -> one value: embedded, averaged, projected."""

    def __init__(self, vocab: int = 10, outputs: int = 1):
        super().__init__()
        self.emb, self.out = nn.Embedding(vocab, 8), nn.Linear(8, outputs)

    def forward(self, x):
        return self.out(self.emb(x).mean(1))


def token_mean(vocab: int = 10, outputs: int = 1):
    return TokenMean(vocab, outputs)


class SeqMean(nn.Module):
    """Float sequences (N, T, C) -> class logits."""

    def __init__(self, channels: int = 2, outputs: int = 2):
        super().__init__()
        self.out = nn.Linear(channels, outputs)

    def forward(self, x):
        return self.out(x.mean(1))


def seq_mean(channels: int = 2, outputs: int = 2):
    return SeqMean(channels, outputs)


# --- data ------------------------------------------------------------------------------------------------------
def write_csv(path, rows, header=("a", "b", "c", "label")):
    path.write_text("\n".join([",".join(header), *(",".join(str(v) for v in r) for r in rows)]) + "\n")
    return path


def class_rows(n=48, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).round(3)
    return [[*r, "cat" if r[0] + r[1] > 0 else "dog"] for r in x]


def train(tmp_path, data, model="test_tabular_data:mlp", args="inputs=3,outputs=2", *extra, out="run"):
    return CliRunner().invoke(cli, ["train", "--model", model, "--model-args", args, "--data", data, *SIZES,
                                    "--out", str(tmp_path / out), *extra])


def evaluate(model_dir, data, *extra):
    return CliRunner().invoke(cli, ["eval", str(model_dir), "--data", data, "--trust-factory", *extra])


# --- training and scoring --------------------------------------------------------------------------------------
def test_csv_classification_trains_and_eval_reports_classes_and_confusion_png(tmp_path):
    data = f"{write_csv(tmp_path / 't.csv', class_rows())}?target=label&features=a,b,c"
    trained = train(tmp_path, data)
    assert trained.exit_code == 0, trained.output
    model = tmp_path / "run" / "model"
    labels = json.loads((model / "labels.json").read_text())
    assert labels["classes"] == ["cat", "dog"] and labels["features"] == ["a", "b", "c"]
    assert "labels.json" in json.loads((model / "prunus.json").read_text())["files"]  # covered by the manifest
    scored = evaluate(model, data)
    assert scored.exit_code == 0, scored.output
    assert "top-1 accuracy" in scored.output and "per class" in scored.output and "confusion matrix" in scored.output
    assert "cat" in scored.output and "dog" in scored.output and "precision" in scored.output
    png = model / "confusion_matrix.png"
    side = round(plot_inches(2) * DPI)
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size == (side, side)
    metrics = json.loads((model / "prunus.json").read_text())["metrics"]
    assert 0 <= metrics["val_accuracy"] <= 1 and "confusion" not in metrics


def test_parquet_regression_reports_mse_mae_r2(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 2))
    pq.write_table(pa.table({"u": x[:, 0], "v": x[:, 1], "y": 2 * x[:, 0] - x[:, 1]}), tmp_path / "t.parquet")
    data = f"{tmp_path / 't.parquet'}?target=y"
    trained = train(tmp_path, data, "test_tabular_data:mlp", "inputs=2,outputs=1", "--task", "regression")
    assert trained.exit_code == 0, trained.output
    model = tmp_path / "run" / "model"
    assert json.loads((model / "labels.json").read_text())["classes"] is None
    scored = evaluate(model, data, "--no-record")
    assert scored.exit_code == 0, scored.output
    assert "mean squared error" in scored.output and "mean absolute error" in scored.output and "R²" in scored.output
    assert not (model / "confusion_matrix.png").exists()
    _, val = module_datasets(data, 0.1, task="regression")
    assert val.x.dtype == torch.float32 and val.y.shape[1:] == (1,)


def test_npy_table_with_integer_labels_trains_and_scores(tmp_path):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(48, 3))
    np.save(tmp_path / "t.npy", np.column_stack([x, (x[:, 0] > 0) * 5 + 2]))  # classes 2 and 7, the last column
    data = str(tmp_path / "t.npy")
    trained = train(tmp_path, data)
    assert trained.exit_code == 0, trained.output
    assert json.loads((tmp_path / "run" / "model" / "labels.json").read_text())["classes"] == [2, 7]
    scored = evaluate(tmp_path / "run" / "model", data)
    assert scored.exit_code == 0 and "top-1 accuracy" in scored.output, scored.output


def test_npz_sequences_tokens_and_floats(tmp_path):
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 10, size=(32, 6))
    np.savez(tmp_path / "tok.npz", x=tokens, y=tokens.mean(1).astype(np.float32))
    trained = train(tmp_path, str(tmp_path / "tok.npz"), "test_tabular_data:token_mean", "vocab=10,outputs=1",
                    "--task", "regression", out="tok")
    assert trained.exit_code == 0, trained.output
    config = json.loads((tmp_path / "tok" / "model" / "config.json").read_text())
    assert config["input"]["shape"] == [6] and config["input"]["dtype"] == "int64"
    seqs = rng.normal(size=(32, 5, 2)).astype(np.float32)
    np.savez_compressed(tmp_path / "seq.npz", inputs=seqs, labels=(seqs[:, :, 0].mean(1) > 0).astype(np.int64))
    data = f"{tmp_path / 'seq.npz'}?features=inputs&target=labels"
    trained = train(tmp_path, data, "test_tabular_data:seq_mean", "channels=2,outputs=2", out="seq")
    assert trained.exit_code == 0, trained.output
    scored = evaluate(tmp_path / "seq" / "model", data, "--no-record")
    assert scored.exit_code == 0 and "top-1 accuracy" in scored.output, scored.output


def test_separate_test_set_is_scored_whole(tmp_path):
    data = f"{write_csv(tmp_path / 'train.csv', class_rows(40))}?target=label"
    test = f"{write_csv(tmp_path / 'test.csv', class_rows(12, seed=9))}?target=label"
    trained = train(tmp_path, data, "test_tabular_data:mlp", "inputs=3,outputs=2", "--test-data", test)
    assert trained.exit_code == 0, trained.output
    train_set, held = module_datasets(data, 0.0, task="classification")
    assert len(train_set) == 40 and held is None  # all of --data trains
    scored = evaluate(tmp_path / "run" / "model", test, "--val-fraction", "1.0", "--no-record")
    assert scored.exit_code == 0, scored.output
    assert "all of it" in scored.output and re.search(r"samples scored\s*│\s*12\s", scored.output), scored.output


# --- bad input: one line, exit 2, nothing written ----------------------------------------------------------------
BAD = [
    ("missing", [[1, 2, 3, "cat"], [1, "", 3, "dog"]], "line 3, column 'b' is empty"),
    ("text", [[1, 2, 3, "cat"], [1, 2, "x7", "dog"]], "line 3, column 'c' holds 'x7', not a number"),
    ("nan", [[1, 2, 3, "cat"], ["nan", 2, 3, "dog"]], "line 3, column 'a' holds 'nan', not a finite number"),
    ("empty", [], "the table is empty"),
]


@pytest.mark.parametrize("name,rows,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_cells_are_one_line_and_nothing_written(tmp_path, assert_user_error, name, rows, needle):
    data = f"{write_csv(tmp_path / 't.csv', rows)}?target=label"
    assert_user_error(train(tmp_path, data), needle)
    assert not (tmp_path / "run").exists()


def test_bad_specs_and_class_counts(tmp_path, assert_user_error):
    csv = write_csv(tmp_path / "t.csv", class_rows(16))
    assert_user_error(train(tmp_path, f"{csv}?target=species"), "target column 'species' does not exist",
                      "a, b, c, label")
    assert_user_error(train(tmp_path, f"{csv}?target=label&sep=;"), "unknown field 'sep'")
    assert_user_error(train(tmp_path, f"{csv}?target=label", "test_tabular_data:mlp", "inputs=3,outputs=3"),
                      "2 classes in the target, but the module scores 3")
    assert_user_error(train(tmp_path, str(tmp_path / "none.csv")), "does not exist")
    assert not (tmp_path / "run").exists()


def test_eval_refuses_unknown_classes_and_oversized_tables(tmp_path, assert_user_error, monkeypatch):
    csv = write_csv(tmp_path / "t.csv", class_rows(24))
    assert train(tmp_path, f"{csv}?target=label").exit_code == 0
    other = write_csv(tmp_path / "o.csv", [[0.1, 0.2, 0.3, "cat"], [0.1, 0.2, 0.3, "eel"]])
    assert_user_error(evaluate(tmp_path / "run" / "model", f"{other}?target=label", "--val-fraction", "1.0"),
                      "line 3, column 'label' holds class 'eel', not among the 2 classes")
    monkeypatch.setenv("PRUNUS_MAX_TABLE_MB", "0.0001")
    assert_user_error(train(tmp_path, f"{csv}?target=label", out="big"), "above PRUNUS_MAX_TABLE_MB")
    monkeypatch.delenv("PRUNUS_MAX_TABLE_MB")
    with open(tmp_path / "forged.npy", "wb") as f:  # a header claiming 8 TB over no data: refused before allocating
        np.lib.format.write_array_header_1_0(f, {"descr": "<f8", "fortran_order": False, "shape": (10**9, 1000)})
    assert_user_error(train(tmp_path, str(tmp_path / "forged.npy"), out="big"), "an array of (1000000000, 1000)",
                      "above PRUNUS_MAX_TABLE_MB")
    assert not (tmp_path / "big").exists()


def test_parquet_nulls_and_text_regression_targets_name_the_cell(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    from prunus.artifacts.errors import PrunusError

    pq.write_table(pa.table({"u": [1.0, None, 3.0], "y": [0.5, 1.5, 2.5]}), tmp_path / "n.parquet")
    with pytest.raises(PrunusError, match=r"row 1, column 'u' is empty"):
        module_datasets(f"{tmp_path / 'n.parquet'}?target=y", task="regression")
    csv = write_csv(tmp_path / "t.csv", class_rows(8))
    with pytest.raises(PrunusError, match=r"line 2, column 'label' holds '(cat|dog)', not a number.*--task classif"):
        module_datasets(f"{csv}?target=label", task="regression")


@pytest.mark.slow  # a compress pass and an ONNX export
def test_compressed_and_exported_dirs_carry_the_class_names(tmp_path):
    """labels.json goes along with every later stage (covered by each dir's manifest), so eval on a compressed dir
    maps the table's labels as training did."""
    data = f"{write_csv(tmp_path / 't.csv', class_rows())}?target=label&features=a,b,c"
    assert train(tmp_path, data).exit_code == 0
    model = tmp_path / "run" / "model"
    want = (model / "labels.json").read_bytes()
    runner = CliRunner()
    r = runner.invoke(cli, ["compress", str(model), "--recipe", "prune-channels-50", "--data", data, "--out",
                            str(tmp_path / "pruned"), "--trust-factory"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli, ["export", str(model), "--out", str(tmp_path / "onnx"), "--data", data, "--trust-factory"],
                      env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    for out in (tmp_path / "pruned", tmp_path / "onnx"):
        assert (out / "labels.json").read_bytes() == want
        assert "labels.json" in json.loads((out / "prunus.json").read_text())["files"]
    scored = evaluate(tmp_path / "pruned", data, "--no-record")
    assert scored.exit_code == 0 and "cat" in scored.output and "dog" in scored.output, scored.output
