"""The CLI end to end, and every bad input: one line, exit code 2, nothing written."""

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from prunus.cli.main import cli
from prunus.models import read_manifest

TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "4", "--warmup-steps", "2", "--eval-every", "3",
        "--eval-tokens", "2048", "--max-corpus-bytes", "200000", "--no-progress"]


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_train_eval_generate_info(tmp_path, trained_run):
    model = tmp_path / "model"
    shutil.copytree(trained_run / "model", model)
    r = run("eval", model, "--max-tokens", 2048)
    assert r.exit_code == 0, r.output
    assert "bits per byte" in r.output and "unigram baseline" in r.output
    metrics = read_manifest(model)["metrics"]
    assert metrics["val_tokens"] == 2048 and 3 < metrics["unigram_bpb"] < 6
    r = run("generate", model, "--prompt", "import ", "--max-new-tokens", 16, "--seed", 1)
    assert r.exit_code == 0 and r.stdout.startswith("import ") and "tokens/s" in r.stderr
    assert run("generate", model, "--prompt", "import ", "--max-new-tokens", 16, "--seed", 1).stdout == r.stdout
    r = run("info", model)
    assert r.exit_code == 0 and "n_kv_heads" in r.output and "model.safetensors" in r.output
    r = run("info", trained_run)
    assert r.exit_code == 0 and "steps done" in r.output and "checkpoints" in r.output


def test_train_stop_and_resume_via_cli(tmp_path):
    out = tmp_path / "run"
    r = run("train", *TINY, "--steps", 6, "--stop-at", 3, "--out", out)
    assert r.exit_code == 0, r.output
    assert not (out / "model").exists()
    r = run("train", "--resume", "--out", out)
    assert r.exit_code == 0, r.output
    assert (out / "model" / "prunus.json").is_file()
    assert [rec["step"] for rec in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == list(range(1, 7))


def test_convert_round_trip_via_cli(tmp_path, trained_run):
    pytest.importorskip("transformers")
    r = run("convert", "--to-hf", trained_run / "model", "--out", tmp_path / "hf")
    assert r.exit_code == 0, r.output
    r = run("convert", "--from-hf", tmp_path / "hf", "--out", tmp_path / "back")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (trained_run / "model" / "model.safetensors").read_bytes()


# --- bad input ---------------------------------------------------------------------------------


def test_missing_data_path(tmp_path, assert_user_error):
    assert_user_error(run("train", *TINY, "--data", tmp_path / "nope.txt", "--out", tmp_path / "o"), "nope.txt", "does not exist")
    assert not (tmp_path / "o").exists()


def test_unreadable_data_path(tmp_path, text_file, monkeypatch, assert_user_error):
    text_file.chmod(0)
    if os.geteuid() == 0:  # root reads whatever the permissions: make the check see what a user would
        monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(text_file))
    assert_user_error(run("train", *TINY, "--data", text_file, "--out", tmp_path / "o"), "not readable")
    assert not (tmp_path / "o").exists()


def test_empty_corpus(tmp_path, assert_user_error):
    (tmp_path / "empty").mkdir()
    assert_user_error(run("train", *TINY, "--data", tmp_path / "empty", "--out", tmp_path / "o"), "corpus is empty")
    assert not (tmp_path / "o").exists()


def test_sequence_length_above_the_model_maximum(tmp_path, assert_user_error):
    r = run("train", *TINY[:2], "--seq-len", 4096, "--out", tmp_path / "o")
    assert_user_error(r, "--seq-len 4096", "max_seq_len 128")
    assert not (tmp_path / "o").exists()


def test_unknown_preset(tmp_path, assert_user_error):
    assert_user_error(run("train", "--preset", "gigantic", "--out", tmp_path / "o"), "unknown preset 'gigantic'", "tiny")
    assert not (tmp_path / "o").exists()


def test_model_dir_with_missing_file_or_hash_mismatch(tmp_path, trained_run, assert_user_error):
    model = tmp_path / "model"
    shutil.copytree(trained_run / "model", model)
    with open(model / "config.json", "a") as f:
        f.write(" ")
    assert_user_error(run("eval", model), "config.json", "hash does not match")
    assert_user_error(run("generate", model, "--prompt", "x"), "hash does not match")
    shutil.copy(trained_run / "model" / "config.json", model / "config.json")
    (model / "model.safetensors").unlink()
    assert_user_error(run("eval", model), "model.safetensors", "missing")
    assert_user_error(run("eval", tmp_path / "absent"), "no such model dir")


def test_hugging_face_dir_that_is_not_llama(tmp_path, assert_user_error):
    hf = tmp_path / "gpt2"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert_user_error(run("convert", "--from-hf", hf, "--out", tmp_path / "o"), "gpt2")
    assert not (tmp_path / "o").exists()


def test_resume_without_checkpoint(tmp_path, assert_user_error):
    assert_user_error(run("train", "--resume", "--out", tmp_path / "none"), "--resume", "no checkpoint")
    r = run("train", *TINY, "--steps", 2, "--out", tmp_path / "done")  # finished, checkpoint-free run
    assert r.exit_code == 0
    assert_user_error(run("train", "--resume", "--out", tmp_path / "done"), "no checkpoint")


def test_output_dir_holding_another_run(tmp_path, trained_run, assert_user_error):
    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    before = sorted(p.name for p in out.rglob("*"))
    assert_user_error(run("train", *TINY, "--steps", 2, "--out", out), "already holds a run", "--overwrite")
    assert sorted(p.name for p in out.rglob("*")) == before
    r = run("train", *TINY, "--steps", 2, "--out", out, "--overwrite")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "run.json").read_text())["train"]["steps"] == 2


def test_resume_with_a_different_run_defining_setting(tmp_path, assert_user_error):
    out = tmp_path / "run"
    assert run("train", *TINY, "--steps", 4, "--stop-at", 2, "--out", out).exit_code == 0
    assert_user_error(run("train", "--resume", "--out", out, "--lr", 0.5), "lr", "another --out")


def test_convert_needs_exactly_one_direction(tmp_path, assert_user_error):
    assert_user_error(run("convert", "--out", tmp_path / "o"), "exactly one")
