"""A draft-sized student by layer dropping: ``depth:N`` keeps N of the teacher's blocks spread from its
first to its last, and ``prunus compress --distill depth:N`` writes a model dir that keeps the teacher's
tokenizer and records where it came from (parent hash, the blocks it started from)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from prunus.artifacts.errors import PrunusError
from prunus.cli.main import cli
from prunus.compress.student import make_student, spread_blocks, teacher_blocks
from prunus.models import HFTokenizer, Transformer, get_preset, load_model, save_model
from prunus.models.model_dir import read_manifest, sha256_file

tokenizers = pytest.importorskip("tokenizers")


def bpe_dir(path):
    """A byte-level BPE tokenizer.json trained on a few sentences."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def get(record):\n    return record['name']\n", "The quick brown fox."] * 20, trainer)
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny random 6-block model dir with a BPE tokenizer."""
    root = tmp_path_factory.mktemp("depth")
    tok = HFTokenizer(bpe_dir(root / "tok"))
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(n_layers=6, vocab_size=320, max_seq_len=64))
    model.init_weights()
    return save_model(model.eval(), root / "teacher", tokenizer=tok, stage="train")


def test_spread_blocks_keeps_the_first_and_the_last():
    assert spread_blocks(30, 15) == [0, 2, 4, 6, 8, 10, 12, 14, 17, 19, 21, 23, 25, 27, 29]
    assert spread_blocks(30, 8) == [0, 4, 8, 12, 17, 21, 25, 29]
    assert spread_blocks(6, 3) == [0, 2, 5] and spread_blocks(6, 6) == list(range(6)) and spread_blocks(6, 1) == [5]
    assert teacher_blocks("depth:3", 6) == [0, 2, 5] and teacher_blocks("keep-every:2", 6) == [0, 2, 4]
    assert teacher_blocks("width:2", 6) is None and teacher_blocks("keep-every:2,width:2", 6) is None


def test_depth_student_copies_the_chosen_blocks(teacher):
    t = load_model(teacher)
    s = make_student(t, "depth:3")
    assert s.config == t.config.replace(n_layers=3)
    src, got = t.state_dict(), s.state_dict()
    for i, j in enumerate([0, 2, 5]):
        for name, value in t.layers[str(j)].state_dict().items():
            assert torch.equal(got[f"layers.{i}.{name}"], value)
    for name in ("tok_embeddings.weight", "norm.weight"):
        assert torch.equal(got[name], src[name])
    for bad in ("depth:0", "depth:7", "depth:1.5", "depth:x"):
        with pytest.raises(PrunusError, match="depth"):
            make_student(t, bad)


def test_compress_distill_depth_writes_a_student_with_its_lineage(teacher, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def get(record):\n    return record['name']\n\nThe quick brown fox.\n" * 300)
    out = tmp_path / "student"
    r = CliRunner().invoke(cli, ["compress", str(teacher), "--distill", "depth:3", "--distill-steps", "2",
                                 "--distill-batch-size", "2", "--data", str(corpus), "--out", str(out),
                                 "--no-latency", "--eval-tokens", "256", "--seq-len", "32"])
    assert r.exit_code == 0, r.output
    student = load_model(out)
    assert student.config.n_layers == 3 and student.config.dim == load_model(teacher).config.dim
    assert sha256_file(out / "tokenizer.json") == sha256_file(teacher / "tokenizer.json")
    manifest = read_manifest(out)
    assert manifest["stage"] == "compress" and manifest["parent"]["path"] == str(teacher.resolve())
    assert manifest["parent"]["hash"]
    record = json.loads((out / "config.json").read_text())["compression"]["distillation"]
    assert record["student"] == "depth:3" and record["teacher_blocks"] == [0, 2, 5] and record["teacher_layers"] == 6
    assert record["steps"] == 2


def test_compress_distill_depth_refuses_too_many_blocks(teacher, tmp_path):
    r = CliRunner().invoke(cli, ["compress", str(teacher), "--distill", "depth:9", "--distill-steps", "1",
                                 "--out", str(tmp_path / "s"), "--no-latency"])
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines()[-1] == "Error: distill: depth:9 must be between 1 and the model's 6 blocks"
    assert not (tmp_path / "s").exists()
