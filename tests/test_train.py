import json

import pytest
import torch

from prunus.models import read_manifest
from prunus.train_parallel import list_checkpoints, lr_at, read_metrics, resume_config, train

def test_resumed_run_equals_uninterrupted_run_bit_exactly(tmp_path, tiny_cfg):
    full = train(tiny_cfg(tmp_path / "full", steps=8))
    first = train(tiny_cfg(tmp_path / "split", steps=8, stop_at=4))
    assert first.model_dir is None and [s for s, _ in list_checkpoints(tmp_path / "split")] == [4]
    rest = train(resume_config(tmp_path / "split"), resume=True)
    assert first.losses + rest.losses == full.losses  # exact float equality
    assert rest.metrics["val_loss"] == full.metrics["val_loss"]
    a = read_manifest(full.model_dir)["files"]["model.safetensors"]
    b = read_manifest(rest.model_dir)["files"]["model.safetensors"]
    assert a == b  # identical final weights


def test_gradient_accumulation_matches_one_large_batch(tmp_path, tiny_cfg):
    big = train(tiny_cfg(tmp_path / "big", batch_size=8, steps=4))
    acc = train(tiny_cfg(tmp_path / "acc", batch_size=8, grad_accum=2, steps=4))
    torch.testing.assert_close(torch.tensor(acc.losses), torch.tensor(big.losses), atol=1e-5, rtol=0)


def test_loss_falls_and_run_dir_is_complete(trained_run):
    records = read_metrics(trained_run)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"} <= records[0].keys()
    assert [r["step"] for r in records if "val_bpb" in r] == [3, 6]
    assert records[-1]["loss"] < records[0]["loss"]
    assert (trained_run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    manifest = read_manifest(trained_run / "model")
    assert manifest["stage"] == "train" and manifest["metrics"]["val_bpb"] == records[-1]["val_bpb"]
    run = json.loads((trained_run / "run.json").read_text())
    assert run["train"]["preset"] == "tiny" and run["model"]["dim"] == 64


def test_checkpoints_rotate_and_leave_no_temp_dirs(tmp_path, tiny_cfg):
    train(tiny_cfg(tmp_path / "r", steps=6, ckpt_every=2, keep_checkpoints=2))
    assert [s for s, _ in list_checkpoints(tmp_path / "r")] == [4, 6]
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["step-4", "step-6"]


def test_a_loss_far_below_the_start_on_a_repetitive_text(tmp_path, text_file, tiny_cfg):
    r = train(tiny_cfg(tmp_path / "r", data=str(text_file), steps=60, lr=1e-2, min_lr=1e-3, eval_every=60))
    assert r.metrics["val_bpb"] < 0.5  # a 44-byte line repeated: almost fully predictable


def test_lr_schedule():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert lr_at(0, **kw) == pytest.approx(0.1) and lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0) and lr_at(109, **kw) == pytest.approx(0.1)
    values = [lr_at(s, **kw) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_training_with_a_hugging_face_tokenizer(tmp_path, text_file, tiny_cfg):
    tokenizers = pytest.importorskip("tokenizers")
    from prunus.models import HFTokenizer, generate, load_model, load_model_tokenizer

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    tok.train([str(text_file)], trainer)
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))

    r = train(tiny_cfg(tmp_path / "run", data=str(text_file), tokenizer=str(tmp_path / "tok"), steps=3))
    tokenizer = load_model_tokenizer(r.model_dir)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.eos_id == 1
    assert (r.model_dir / "tokenizer.json").read_bytes() == (tmp_path / "tok" / "tokenizer.json").read_bytes()
    ids = torch.tensor([tokenizer.encode("the quick brown")])
    out = generate(load_model(r.model_dir), ids, 4)
    assert tokenizer.decode(out[0, : ids.shape[1]].tolist()).strip() == "the quick brown"
    assert 0 < r.metrics["val_bpb"] < 20


def test_async_checkpoints_resume_like_sync_ones(tmp_path, tiny_cfg):
    sync = train(tiny_cfg(tmp_path / "sync", steps=6, stop_at=4, ckpt_every=2))
    bg = train(tiny_cfg(tmp_path / "bg", steps=6, stop_at=4, ckpt_every=2, async_checkpoint=True))
    assert bg.losses == sync.losses
    assert sorted(p.name for p in (tmp_path / "bg" / "checkpoints").iterdir()) == ["step-2", "step-4"]
    rest = train(resume_config(tmp_path / "bg"), resume=True)
    full = train(tiny_cfg(tmp_path / "full", steps=6))
    assert bg.losses + rest.losses == full.losses


def test_a_warmup_longer_than_the_run_is_warned_about(tmp_path, tiny_cfg, capsys):
    """--warmup-steps above --steps: one warning line on stderr (the learning rate never reaches --lr), also
    with the progress output off; a warmup within the run gives none."""
    train(tiny_cfg(tmp_path / "long", steps=2, warmup_steps=5, eval_every=2))
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(lines) == 1 and "--warmup-steps 5 exceeds --steps 2" in lines[0] and "lower --warmup-steps" in lines[0]
    train(tiny_cfg(tmp_path / "short", steps=2, warmup_steps=2, eval_every=2))
    assert "warning" not in capsys.readouterr().err
