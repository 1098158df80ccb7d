"""Instruction data: rows rendered with a loss mask (hand-made examples), packing that scores every document
as it would alone, batches a pure function of (seed, step, rank), the held-out split, and every bad input
as one line naming the file and line."""

import json
import sys

import numpy as np
import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.data.instruct import load_documents, read_rows, render_row
from prunus.data.packing import IGNORE_INDEX, PAD_DOC, PackedBatch, get_packed_batch, load_packed, pack, step_rows
from prunus.data.prefetch import to_device
from prunus.models import Transformer, get_preset
from prunus.models.tokenizer import ByteTokenizer

BYTES = ByteTokenizer()


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_prompt_completion_mask_by_hand():
    doc = render_row({"prompt": "ab", "completion": "cd"}, "x line 1", BYTES)
    assert doc.tokens.tolist() == [97, 98, 99, 100, BYTES.eos_id]
    assert doc.trained.tolist() == [False, False, True, True, True]
    packed = pack([doc], seq_len=6)
    # inputs a b c d; targets: b (prompt: ignored), c, d, eos; then one padding position
    assert packed.tokens[0, :4].tolist() == [97, 98, 99, 100]
    assert packed.targets[0].tolist() == [IGNORE_INDEX, 99, 100, BYTES.eos_id, IGNORE_INDEX, IGNORE_INDEX]
    assert packed.positions[0].tolist() == [0, 1, 2, 3, 0, 1] and packed.doc_ids[0].tolist() == [0, 0, 0, 0, PAD_DOC, PAD_DOC]
    everything = render_row({"prompt": "ab", "completion": "cd"}, "x line 1", BYTES, train_on_prompt=True)
    assert everything.trained.all()
    text = render_row({"text": "hi"}, "x line 1", BYTES)
    assert text.trained.all() and text.tokens.tolist() == [104, 105, BYTES.eos_id]


def test_chat_rows_train_on_assistant_turns_only(tmp_path):
    pytest.importorskip("transformers")
    from test_chat import CHAT_TEMPLATE, hf_tokenizer_dir

    from prunus.models import HFTokenizer

    tok = HFTokenizer(hf_tokenizer_dir(tmp_path / "tok", CHAT_TEMPLATE))
    chat = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Be brief"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "line by line"}]
    doc = render_row({"messages": chat}, "f line 1", tok)
    assert doc.tokens.tolist() == tok.encode(tok.apply_chat_template(chat, add_generation_prompt=False))
    trained_text = tok._tok.decode(doc.tokens[doc.trained].tolist(), skip_special_tokens=False)
    assert trained_text == "Be brief<|im_end|>\nline by line<|im_end|>\n"  # the answers, their end-of-turn included
    assert not doc.trained[: len(tok.encode(tok.apply_chat_template(chat[:1])))].any()
    # a role the template refuses: one line naming the file and line
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": chat}, {"messages": [{"role": "robot", "content": "x"}]}])
    with pytest.raises(PrunusError, match=r"bad.jsonl line 2: .*Unknown role: robot"):
        load_documents(bad, tok)


def test_packed_documents_score_as_if_alone():
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(n_layers=2)).eval()
    model.init_weights()
    rng = np.random.default_rng(0)
    docs = [render_row({"text": bytes(rng.integers(97, 123, n).tolist()).decode()}, f"r{n}", BYTES) for n in (5, 11, 7, 3, 20)]
    packed = pack(docs, seq_len=32)
    assert packed.n_rows == 2 and packed.truncated == 0
    x, y, pos, ids = (torch.from_numpy(a) for a in (packed.tokens, packed.targets, packed.positions, packed.doc_ids))
    with torch.no_grad():
        logits = model(x, positions=pos, doc_ids=ids)
        checked = 0
        for r in range(packed.n_rows):
            for d in sorted(set(ids[r].tolist()) - {PAD_DOC}):
                where = (ids[r] == d).nonzero().flatten()
                alone = model(x[r:r + 1, where])[0]
                assert (logits[r, where] - alone).abs().max() <= 1e-5
                checked += 1
        assert checked == len(docs)
        # without the mask, attention would cross documents: the check above is not vacuous
        crossed = model(x)
        assert (crossed[0, 5:16] - logits[0, 5:16]).abs().max() > 1e-3


def test_long_rows_are_truncated_and_counted(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "completion": "x" * 100}] + [{"text": f"row {i}"} for i in range(30)])
    corpus = load_packed(path, BYTES, seq_len=16)
    assert corpus.truncated == 1
    assert "1 of 31 rows" in corpus.truncation_note(16) and "--seq-len 16" in corpus.truncation_note(16)
    assert corpus.train.tokens.shape[1] == 16


def test_batches_are_a_pure_function_of_seed_step_rank(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "completion": f"answer {i}"} for i in range(60)])
    rows = load_packed(path, BYTES, seq_len=24).train
    one = get_packed_batch(rows, seed=3, step=5, micro_batch=4)
    again = get_packed_batch(rows, seed=3, step=5, micro_batch=4)
    tensors = ("inputs", "targets", "positions", "doc_ids")
    assert all(torch.equal(getattr(one, f), getattr(again, f)) for f in tensors) and one.n_trained == again.n_trained
    halves = [get_packed_batch(rows, seed=3, step=5, micro_batch=2, rank=r, world=2) for r in range(2)]
    assert torch.equal(torch.cat([h.inputs for h in halves]), one.inputs)  # ranks split the same global batch
    assert halves[0].n_trained == halves[1].n_trained == one.n_trained == int((one.targets != IGNORE_INDEX).sum())
    assert one.model_kwargs().keys() == {"positions", "doc_ids"}
    moved = to_device(one, torch.device("cpu"))  # the prefetcher moves each tensor of a typed batch
    assert isinstance(moved, PackedBatch) and torch.equal(moved.doc_ids, one.doc_ids) and moved.n_trained == one.n_trained
    # an epoch visits every row once before any repeats
    n = rows.n_rows
    seen = np.concatenate([step_rows(3, s, 4, n) for s in range(n // 4)])
    assert len(set(seen.tolist())) == len(seen)


def test_held_out_split_is_stable(tmp_path):
    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(200)]
    train, val = load_documents(write_jsonl(tmp_path / "a.jsonl", rows), BYTES)
    train2, val2 = load_documents(write_jsonl(tmp_path / "b.jsonl", rows[::-1]), BYTES)
    assert 1 <= len(val) < 40 and len(train) + len(val) == 200
    assert sorted(d.tokens.tobytes() for d in val) == sorted(d.tokens.tobytes() for d in val2)


@pytest.mark.parametrize("line, needle", [
    ('{"prompt": "only a prompt"}', r"d.jsonl line 3: 'completion' must be a string"),
    ('{"question": "x", "answer": "y"}', r"d.jsonl line 3: the row has none of the fields"),
    ('{"messages": []}', r"d.jsonl line 3: 'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', r"d.jsonl line 3: messages\[0\] needs a 'role' and a 'content'"),
    ("{not json", r"d.jsonl line 3: not JSON"),
    ('["a list"]', r"d.jsonl line 3: a row must be a JSON object"),
])
def test_bad_rows_name_file_and_line(tmp_path, line, needle):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, "", line])
    with pytest.raises(PrunusError, match=needle):
        load_documents(path, BYTES)


def test_messages_need_a_chat_template(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(PrunusError, match=r"d.jsonl line 1: 'messages' rows need a tokenizer with a chat template"):
        load_documents(path, BYTES)


def test_token_ids_beyond_the_vocabulary(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "abc"}, {"text": "\u00ff"}])
    with pytest.raises(PrunusError, match=r"d.jsonl line 1: token id .* outside the model's vocabulary of 100"):
        load_documents(path, BYTES, vocab_size=100)


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(PrunusError, match=r"d.parquet: reading Parquet needs pyarrow: pip install 'prunus\[parquet\]'"):
        list(read_rows(tmp_path / "d.parquet"))


def test_parquet_rows_match_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(20)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    got = load_documents(tmp_path / "d.parquet", BYTES)
    want = load_documents(write_jsonl(tmp_path / "d.jsonl", rows), BYTES)
    for a, b in zip(got, want):
        assert [d.tokens.tolist() for d in a] == [d.tokens.tolist() for d in b]
        assert [d.trained.tolist() for d in a] == [d.trained.tolist() for d in b]
    pq.write_table(pa.Table.from_pylist([{"prompt": "x"}]), tmp_path / "bad.parquet")
    with pytest.raises(PrunusError, match=r"bad.parquet row 1: 'completion' must be a string"):
        load_documents(tmp_path / "bad.parquet", BYTES)


# --- hostile rows: bounded before parsing and tokenizing, one line naming the file and line ----------

class NoBigText:
    """A tokenizer that fails the test when text longer than a few KB reaches it."""

    eos_id, n_vocab, chat_template = 256, 257, None

    def encode(self, text):
        assert len(text) < 10_000, "a huge line reached the tokenizer"
        return BYTES.encode(text)

    def encode_array(self, data):
        assert len(data) < 10_000, "a huge line reached the tokenizer"
        return BYTES.encode_array(data)


HOSTILE_LINES = [
    ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested more than 100 deep"),
    ('{"text": "ab", "n": ' + "9" * 5000 + "}", "an integer of more than 4,300 digits"),
    ('{"text": "a\\ud800b"}', "not valid UTF-8 (a lone surrogate '\\ud800')"),
    ('{"prompt": "p", "completion": "\\udfff"}', "a lone surrogate '\\udfff'"),
    ('{"messages": [{"role": "user", "content": "x"}], "\\udbff": 1}', "a lone surrogate"),
    (b'{"text": "caf\xe9"}', "not UTF-8 text (invalid continuation byte at byte 13 of the line)"),
    ('{"messages": [' + ", ".join(['{"role": "user", "content": "x"}'] * 1025) + "]}", "1,025 messages, above the 1,024"),
]


@pytest.mark.parametrize("line, needle", HOSTILE_LINES, ids=["deep", "bigint", "surrogate", "surrogate-completion",
                                                             "surrogate-key", "not-utf8", "many-messages"])
def test_hostile_rows_are_one_line(tmp_path, line, needle):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "fine"}\n' + (line if isinstance(line, bytes) else line.encode()) + b"\n")
    with pytest.raises(PrunusError) as e:
        load_documents(path, NoBigText())
    assert str(e.value).startswith(f"{path} line 2: ") and needle in str(e.value) and "\n" not in str(e.value)


def test_a_huge_line_is_refused_before_it_is_read_whole(tmp_path):
    from prunus.data.bounded_lines import MAX_LINE_BYTES

    path = tmp_path / "d.jsonl"
    with open(path, "wb") as f:  # a 50 MB row once aborted the process inside the tokenizer
        f.write(b'{"text": "fine"}\n{"text": "fine"}\n{"text": "' + b"x" * (MAX_LINE_BYTES + 10) + b'"}\n')
    with pytest.raises(PrunusError, match=rf"d.jsonl line 3: longer than {MAX_LINE_BYTES:,} bytes"):
        load_documents(path, NoBigText())
    within = tmp_path / "ok.jsonl"  # a long row under the cap is read (and a CRLF file and a BOM are fine)
    within.write_bytes(b'\xef\xbb\xbf{"text": "' + b"y" * 5000 + b'"}\r\n{"text": "two"}\r\n')
    train, val = load_documents(within, BYTES)
    assert sorted(len(d.tokens) for d in train + val) == [4, 5001]


def test_a_huge_parquet_cell_is_refused_before_tokenizing(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    monkeypatch.setattr("prunus.data.instruct.MAX_LINE_BYTES", 1000)
    pq.write_table(pa.Table.from_pylist([{"text": "fine"}, {"text": "x" * 2000}]), tmp_path / "d.parquet")
    with pytest.raises(PrunusError, match=r"d.parquet row 2: 2,\d{3} bytes, above the 1,000 one row may hold"):
        load_documents(tmp_path / "d.parquet", NoBigText())
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(PrunusError, match=r"bad.parquet: not a readable Parquet file"):
        load_documents(tmp_path / "bad.parquet", NoBigText())


def test_a_text_corpus_with_a_huge_line(tmp_path):
    from prunus.data import load_corpus
    from prunus.data.bounded_lines import MAX_LINE_BYTES

    path = tmp_path / "c.txt"
    path.write_bytes(b"short line\n" * 2 + b"z" * (MAX_LINE_BYTES + 1) + b"\nend\n")
    with pytest.raises(PrunusError, match=rf"data path {path} line 3: longer than {MAX_LINE_BYTES:,} bytes"):
        load_corpus(path, NoBigText())
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.txt").write_bytes(b"z" * (MAX_LINE_BYTES + 1))
    with pytest.raises(PrunusError, match=r"a.txt line 1: longer than"):
        load_corpus(tmp_path / "dir", NoBigText())
