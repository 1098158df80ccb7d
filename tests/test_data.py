import math

import numpy as np
import pytest
import torch

from prunus.data import Prefetcher, evaluate, get_batch, load_corpus, unigram_bits_per_byte
from prunus.data.corpus import _path_hash, stdlib_files
from prunus.models import ByteTokenizer, PrunusError

TOK = ByteTokenizer()


def test_builtin_corpus_is_deterministic_split_and_capped():
    a = load_corpus(None, TOK, max_bytes=300_000)
    b = load_corpus("builtin", TOK, max_bytes=300_000)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert a.train_bytes <= 300_000 and len(a.val) > 10_000
    root, files = stdlib_files()
    val_files = {f for f in files if _path_hash(f.relative_to(root).as_posix()) < 0.05}
    assert 0 < len(val_files) < len(files) // 10
    # the validation split does not depend on the training cap
    assert np.array_equal(load_corpus(None, TOK, max_bytes=100_000).val, a.val)


def test_text_file_dir_and_token_binaries(tmp_path, text_file):
    c = load_corpus(text_file, TOK)
    assert len(c.train) + len(c.val) == text_file.stat().st_size
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(30):
        (d / f"doc{i}.txt").write_text(f"document {i}\n" * 20)
    c = load_corpus(d, TOK)
    assert len(c.train) > len(c.val) > 0 and TOK.eos_id in c.train
    tokens = np.arange(1000, dtype=np.uint16) % 300
    tokens.tofile(tmp_path / "tok.bin")
    c = load_corpus(tmp_path / "tok.bin", TOK)
    assert isinstance(c.train, np.memmap) and len(c.train) == 950 and len(c.val) == 50
    tokens.tofile(tmp_path / "train.bin")
    tokens[:100].tofile(tmp_path / "val.bin")
    c = load_corpus(tmp_path, TOK)
    assert len(c.train) == 1000 and len(c.val) == 100


def test_bad_corpora(tmp_path):
    with pytest.raises(PrunusError, match="does not exist"):
        load_corpus(tmp_path / "missing.txt", TOK)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(PrunusError, match="corpus is empty"):
        load_corpus(tmp_path / "empty.txt", TOK)
    (np.arange(100, dtype=np.uint16) + 300).tofile(tmp_path / "big.bin")
    with pytest.raises(PrunusError, match="vocab_size 320"):
        load_corpus(tmp_path / "big.bin", TOK, vocab_size=320)


def test_batches_are_a_pure_function_of_seed_step_rank():
    tokens = np.arange(10_000, dtype=np.uint16) % 256
    kw = dict(seed=1, step=5, micro_batch=2, seq_len=16)
    x, y = get_batch(tokens, **kw)
    assert torch.equal(x, get_batch(tokens, **kw)[0]) and torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, get_batch(tokens, **{**kw, "step": 6})[0])
    # two ranks x two micro-steps partition the same global batch one rank sees with batch 8
    whole = get_batch(tokens, seed=1, step=5, micro_batch=8, seq_len=16)[0]
    parts = [get_batch(tokens, **kw, grad_accum=2, micro=m, rank=r, world=2)[0] for m in range(2) for r in range(2)]
    assert torch.equal(torch.cat(parts), whole)


def test_prefetcher_yields_in_order_and_reraises():
    with Prefetcher(lambda k: torch.full((2,), k), range(5)) as p:
        assert [int(b[0]) for _, b in p] == list(range(5))

    def boom(k):
        if k == 2:
            raise ValueError("bad batch")
        return k

    with Prefetcher(boom, range(5)) as p, pytest.raises(ValueError, match="bad batch"):
        list(p)


def test_bits_per_byte_of_a_uniform_model():
    vocab = 320
    tokens = np.arange(2000, dtype=np.uint16) % 256  # bytes only: one byte per token

    def uniform(x):
        return torch.zeros(*x.shape, vocab)

    r = evaluate(uniform, tokens, TOK.token_bytes(), seq_len=32, batch_size=4)
    assert r["val_loss"] == pytest.approx(math.log(vocab), rel=1e-6)
    assert r["val_bpb"] == pytest.approx(math.log2(vocab), rel=1e-6)


def test_unigram_baseline():
    train = np.array([0, 0, 0, 1] * 50_000, dtype=np.uint16)
    bpb = unigram_bits_per_byte(train, train, TOK.token_bytes())
    assert 0.811 < bpb < 0.815  # entropy of (3/4, 1/4) is 0.8113 bits, plus add-one smoothing
