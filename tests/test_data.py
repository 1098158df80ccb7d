import importlib
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


def test_prose_corpus_is_fixed_and_the_default_for_pretrained_tokenizers():
    from prunus.data import PROSE, default_data

    a, b = load_corpus(PROSE, TOK), load_corpus("prose", TOK, max_bytes=50_000)
    assert np.array_equal(a.val, b.val) and len(b.train) < len(a.train)  # max_bytes caps training only
    assert a.val_bytes > 100_000 and a.name.startswith("prose")
    assert b"exception" in bytes(a.val[:200_000].astype(np.uint8))
    assert default_data(None, TOK) is None and default_data("x.txt", TOK) == "x.txt"

    class Pretrained:
        def spec(self):
            return {"kind": "hf", "file": "tokenizer.json"}

    assert default_data(None, Pretrained()) == PROSE


def test_windowed_chunked_evaluation_matches_whole_logits(monkeypatch):
    ev = importlib.import_module("prunus.data.evaluate")  # the package exports a function of the same name
    from prunus.models import Transformer, get_preset

    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(max_seq_len=64)).eval()
    model.init_weights()
    tokens = np.arange(3000, dtype=np.uint16) * 7 % 256
    kw = dict(seq_len=64, max_tokens=1000)
    whole = evaluate(lambda x: model(x), tokens, TOK.token_bytes(), **kw)  # a callable: whole-window logits
    monkeypatch.setattr(ev, "LOGITS_BYTES", 4 * len(TOK.token_bytes()) * 10)  # 10 positions of logits at a time
    calls = []
    model.output.register_forward_hook(lambda m, a, out: calls.append(out.shape[0] * out.shape[1] if out.ndim == 3 else out.shape[0]))
    chunked = evaluate(model, tokens, TOK.token_bytes(), **kw)
    assert chunked["val_tokens"] == whole["val_tokens"] == 960 and chunked["seq_len"] == 64
    assert chunked["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-5)
    assert max(calls) <= 10  # the head never ran on more than one chunk (or the 8-position check)

    class Capped(torch.nn.Module):  # logits are not output(hidden): the check falls back to whole windows
        def __init__(self, inner):
            super().__init__()
            self.inner, self.output = inner, inner.output

        def forward(self, x):
            return 5 * torch.tanh(self.inner(x) / 5)

    capped = Capped(model)
    assert not ev.output_head_is_last(capped, torch.zeros(1, 8, dtype=torch.long))
    got = evaluate(capped, tokens, TOK.token_bytes(), **kw)
    want = evaluate(lambda x: capped(x), tokens, TOK.token_bytes(), **kw)
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
    # a family with final logit soft-capping (Gemma 2) keeps the chunked path
    gemma_like = Transformer(model.config.replace(final_softcap=5.0)).eval()
    gemma_like.load_state_dict(model.state_dict())
    assert ev.output_head_is_last(gemma_like, torch.zeros(1, 8, dtype=torch.long))
    got = evaluate(gemma_like, tokens, TOK.token_bytes(), **kw)
    want = evaluate(lambda x: gemma_like(x), tokens, TOK.token_bytes(), **kw)
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5) and got["val_loss"] != pytest.approx(whole["val_loss"])


def test_prefetcher_moves_dict_and_dataclass_batches():
    with Prefetcher(lambda k: {"x": torch.full((2,), k), "y": [torch.tensor(k)]}, range(3)) as p:
        got = [(int(b["x"][0]), int(b["y"][0])) for _, b in p]
    assert got == [(0, 0), (1, 1), (2, 2)] and p.stream is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the side-stream copy is CUDA only)")
def test_cuda_prefetch_copies_on_a_side_stream_and_the_step_sees_whole_batches():
    """Large batches copied on the side stream while the default stream is busy with matrix products:
    every batch the step reads equals the host batch it came from (the step waited for its copy)."""
    make = lambda k: torch.randn(2048, 2048, generator=torch.Generator().manual_seed(k))
    busy = torch.randn(4096, 4096, device="cuda")
    sums = []
    with Prefetcher(make, range(6), device="cuda", depth=3) as p:
        assert p.stream is not None and p.stream != torch.cuda.default_stream()
        for key, batch in p:
            assert batch.is_cuda
            for _ in range(4):
                busy = (busy @ busy).tanh_()  # keeps the default stream busy while the next copies run
            sums.append((key, float(batch.double().sum())))
    torch.cuda.synchronize()
    assert [k for k, _ in sums] == list(range(6))
    for k, s in sums:
        assert s == pytest.approx(float(make(k).double().sum()), rel=1e-9, abs=1e-6)
