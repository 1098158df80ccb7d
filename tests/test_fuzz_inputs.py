"""Seeded, time-bounded fuzzing of the readers of outside bytes: a model dir's safetensors header (its length
field, its JSON: dtype, shape, data_offsets, names, metadata) and config.json (type swaps, huge and negative
integers, deletions, non-UTF-8 bytes), and fine-tuning JSONL rows. Every case is a valid input with a few random
mutations; each must load or raise a one-line PrunusError, never another exception.

The cases are a pure function of the seed; each reader gets a fixed time budget (a few hundred cases), so a run
takes a few seconds. A failure names the seed and the case: ``FUZZ_SEED=<seed> pytest tests/test_fuzz_inputs.py``
reruns the same cases, and ``FUZZ_SECONDS`` gives each reader a longer budget.
"""

from __future__ import annotations

import copy
import json
import os
import random
import struct
import time
from pathlib import Path

import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.safetensors_header import read_header
from prunus.data.instruct import load_documents
from prunus.models import Transformer, get_preset, load_model, save_model
from prunus.models.model_dir import load_model_tokenizer
from prunus.models.tokenizer import ByteTokenizer

SEED = int(os.environ.get("FUZZ_SEED", "20240607"))
SECONDS = float(os.environ.get("FUZZ_SECONDS", "1.0"))  # per reader
MAX_CASES = 100_000

JUNK = [None, True, False, 0, 1, -1, 7, 2**31, 2**63, 2**64 + 1, -2**63, 10**30, 1.5, -0.0, 1e308, "", "x", "F32",
        "BF16", "I8", "U8", "../x", "\udc80", "a" * 300, [], [1], [-1, 2], [1.5], [[1]], ["1"], [2**64, 0], {}, {"a": 1},
        {"dtype": "F32"}]
HUGE_INTS = [0, -1, -2**63, 2**31 - 1, 2**32, 2**53 + 1, 2**63, 2**64, 10**40]


def _expect_one_line(call, case: str) -> None:
    try:
        call()
    except PrunusError as e:
        assert str(e).strip() and "\n" not in str(e), f"{case}: a PrunusError that is not one line: {str(e)[:300]!r}"
    except Exception as e:  # noqa: BLE001 - anything else is the finding
        raise AssertionError(f"seed {SEED}, {case}: {type(e).__name__} instead of a one-line PrunusError: "
                             f"{str(e)[:300]}") from e


def _budget():
    """(case number, rng) until the reader's time is up; the rng's stream depends on the seed only."""
    rng, end = random.Random(SEED), time.monotonic() + SECONDS
    for i in range(MAX_CASES):
        if time.monotonic() > end:
            return
        yield i, rng


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(n_layers=1))
    model.init_weights()
    out = tmp_path_factory.mktemp("fuzz") / "m"
    save_model(model, out, stage="test")
    load_model(out, verify=False)  # warm: the first load pays for imports, not the budget
    return out


def _copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# --- (a) safetensors headers -----------------------------------------------------------------------

def _split_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _mutate_header(header: dict, data_len: int, rng: random.Random) -> None:
    names = [k for k in header if k != "__metadata__"]
    if not names:
        return
    name = rng.choice(names)
    entry = header[name]
    if not isinstance(entry, dict):  # an earlier mutation made it junk
        return
    op = rng.randrange(9)
    offsets = entry.get("data_offsets")
    if op == 0:
        entry[rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(JUNK)
    elif op == 1 and isinstance(entry.get("shape"), list):
        shape = entry["shape"]
        choice = rng.randrange(4)
        if choice == 0 and shape:
            shape[rng.randrange(len(shape))] = rng.choice(HUGE_INTS + [rng.randint(0, 500)])
        elif choice == 1:
            shape.append(rng.choice([0, 1, 2, 2**40]))
        elif choice == 2 and shape:
            shape.pop()
        else:
            entry["shape"] = list(reversed(shape))
    elif op == 2 and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets):
        a, b = offsets
        entry["data_offsets"] = rng.choice([[b, a], [a, b + 1], [a - 1, b], [a, data_len + 8], [-8, b - a - 8],
                                            [a, 2**64], [2**63, 2**63 + b - a], [a + 0.5, b], [a], [a, b, b], [0, 0]])
    elif op == 3:
        entry["dtype"] = rng.choice(["F16", "BF16", "I32", "U32", "I64", "F64", "F8_E4M3", "BOOL", "F4", "f32"])
    elif op == 4:
        entry.pop(rng.choice(["dtype", "shape", "data_offsets"]), None)
    elif op == 5:
        header[rng.choice(["", "../escape", "\udc80", "x" * 5000, name + ".copy"])] = copy.deepcopy(entry)
    elif op == 6:
        del header[name]
    elif op == 7:
        header["__metadata__"] = rng.choice(JUNK + [{"format": rng.choice(JUNK)}])
    else:
        header[name] = rng.choice(JUNK)


def _header_bytes(header: dict, rng: random.Random) -> bytes:
    text = json.dumps(header).encode()
    op = rng.randrange(8)
    if op == 0 and text:
        i = rng.randrange(len(text))
        text = text[:i] + bytes([rng.randrange(256)]) + text[i + 1:]
    elif op == 1:
        text = text[:rng.randrange(len(text) + 1)]
    elif op == 2:
        i = rng.randrange(len(text) + 1)
        text = text[:i] + rng.choice([b"\xff\xfe", b"\xc3", b"\x00", b"[" * 5000, b"9" * 5000, b"NaN"]) + text[i:]
    return text


def _length_field(true_len: int, file_len: int, rng: random.Random) -> int:
    if rng.random() < 0.7:
        return true_len
    return rng.choice([0, 1, 7, true_len - 1, true_len + 1, file_len - 8, file_len, 2**63, 2**64 - 1,
                       rng.randrange(2**64), 100 << 20, (100 << 20) + 1])


def test_fuzz_safetensors_headers(model_dir, tmp_path):
    header, data = _split_safetensors(model_dir / "model.safetensors")
    fuzz_dir = _copy_dir(model_dir, tmp_path / "m")
    weights = fuzz_dir / "model.safetensors"
    for i, rng in _budget():
        mutated = copy.deepcopy(header)
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            _mutate_header(mutated, len(data), rng)
        body = _header_bytes(mutated, rng)
        n = _length_field(len(body), 8 + len(body) + len(data), rng)
        cut = rng.choice([len(data)] * 6 + [0, len(data) // 2, len(data) - 1])
        weights.write_bytes(struct.pack("<Q", n) + body + data[:cut])
        case = f"safetensors case {i} (length field {n}, header {body[:200]!r}...)"
        _expect_one_line(lambda: read_header(weights), case)
        if i % 4 == 0:  # the whole loader too: the header against the config, then the tensors
            _expect_one_line(lambda: load_model(fuzz_dir, verify=False), case)
    assert i > 10, "the budget ran out before the fuzzer got going"


# --- (b) config.json ---------------------------------------------------------------------------------

def _mutate_config(config: dict, rng: random.Random) -> None:
    model = config.get("model") if isinstance(config.get("model"), dict) else None
    op = rng.randrange(8)
    if op in (0, 1) and model:
        model[rng.choice(sorted(model))] = rng.choice(JUNK if op == 0 else HUGE_INTS)
    elif op == 2 and model:
        field = rng.choice(sorted(model))
        if isinstance(model[field], int) and not isinstance(model[field], bool):
            model[field] = rng.choice([model[field] * 2, model[field] - 1, -model[field], model[field] + 10**6])
    elif op == 3 and model:
        del model[rng.choice(sorted(model))]
    elif op == 4 and config:
        del config[rng.choice(sorted(config))]
    elif op == 5:
        config[rng.choice(sorted(config) + ["compression", "hf", "bogus"])] = rng.choice(JUNK)
    elif op == 6:
        config["tokenizer"] = rng.choice([{"kind": rng.choice(JUNK)}, {"kind": "hf", "file": rng.choice(JUNK)},
                                          {"kind": "hf", "file": "../../etc/passwd"}, {"kind": "byte", "x": 1}])
    else:
        config["compression"] = rng.choice([{"quantization": rng.choice(JUNK)}, {"sparsity": rng.choice(JUNK)},
                                            {"quantization": {"scheme": "int8-weight-only", "modules": rng.choice(JUNK)}},
                                            {"distillation": rng.choice(JUNK)}])


def _config_bytes(config, rng: random.Random) -> bytes:
    text = json.dumps(config, indent=rng.choice([None, 2])).encode()
    op = rng.randrange(7)
    if op == 0:
        i = rng.randrange(len(text) + 1)
        text = text[:i] + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x00"]) + text[i:]
    elif op == 1:
        text = text[:rng.randrange(len(text) + 1)]
    elif op == 2:
        text = text.replace(b'"dim": 64', rng.choice([b'"dim": ' + b"9" * 5000, b'"dim": 1e999', b'"dim": NaN',
                                                      b'"dim": ' + b"[" * 50_000, b'"dim": 64, "dim": "x"']))
    return text


def _changes(base: dict, config) -> str:
    """What a mutation changed, for the failure message (a config is longer than a message should be)."""
    if not isinstance(config, dict):
        return f"config {config!r:.80}"
    out = [f"{k}={config.get(k, '<deleted>')!r:.80}" for k in sorted(set(base) | set(config))
           if k != "model" and base.get(k) != config.get(k)]
    model, was = config.get("model"), base["model"]
    if isinstance(model, dict):
        out += [f"model.{k}={model.get(k, '<deleted>')!r:.80}" for k in sorted(set(was) | set(model))
                if was.get(k) != model.get(k)]
    elif model != was:
        out.append(f"model={model!r:.80}")
    return ", ".join(out) or "no change to the values"


def test_fuzz_model_config(model_dir, tmp_path):
    base = json.loads((model_dir / "config.json").read_text())
    fuzz_dir = _copy_dir(model_dir, tmp_path / "m")
    for i, rng in _budget():
        config = copy.deepcopy(base)
        for _ in range(rng.choice([1, 1, 2, 3])):
            _mutate_config(config, rng)
        text = _config_bytes(config, rng)
        (fuzz_dir / "config.json").write_bytes(text)
        case = f"config case {i} ({_changes(base, config)}; {len(text)} bytes, from byte 0: {text[:80]!r})"
        _expect_one_line(lambda: load_model(fuzz_dir, verify=False), case)
        _expect_one_line(lambda: load_model_tokenizer(fuzz_dir), case)
    assert i > 10, "the budget ran out before the fuzzer got going"


# --- (c) fine-tuning JSONL rows ------------------------------------------------------------------------

ROWS = [{"text": "plain text"}, {"prompt": "2 + 2?", "completion": "4"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]


def _mutate_row(row, rng: random.Random):
    if not isinstance(row, dict) or rng.random() < 0.1:
        return rng.choice(JUNK)
    row = copy.deepcopy(row)
    key = rng.choice(sorted(row) + ["text", "prompt", "completion", "messages", "extra"])
    op = rng.randrange(6)
    if op == 0:
        row[key] = rng.choice(JUNK)
    elif op == 1:
        row.pop(key, None)
    elif op == 2:
        row[key] = rng.choice(["a\ud800b", "\udfff", "x" * rng.choice([0, 1, 10_000]), "\x00", "\u2028", "é" * 50])
    elif op == 3 and isinstance(row.get("messages"), list):
        m = row["messages"]
        j = rng.randrange(len(m))
        m[j] = rng.choice([rng.choice(JUNK), {"role": rng.choice(JUNK), "content": "x"},
                           {"role": "assistant", "content": rng.choice(JUNK)}, {**m[j], "extra": rng.choice(JUNK)}])
    elif op == 4:
        row[key] = rng.choice([[[[]]], {"a": {"b": {"c": [1]}}}, 10**4300 // 10**4000])
    else:
        row["messages"] = [{"role": "assistant", "content": "ok"}] * rng.choice([1, 3, 1025])
    return row


def _line_bytes(row, rng: random.Random) -> bytes:
    text = json.dumps(row, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    op = rng.randrange(8)
    if op == 0:
        i = rng.randrange(len(text) + 1)
        text = text[:i] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\r", b"\x00"]) + text[i:]
    elif op == 1:
        text = text[:rng.randrange(len(text) + 1)]
    elif op == 2:
        text = rng.choice([b"[" * 100_000 + b"]" * 100_000, b'{"text": ' + b"9" * 5000 + b"}",
                           b'{"text": "\\ud800"}', b"\xef\xbb\xbf" + text, b'{"text": "a", "text": 5}', b"NaN"])
    return text


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The byte tokenizer, and a Hugging Face one with a chat template where transformers is installed."""
    found = [ByteTokenizer()]
    try:
        from test_chat import CHAT_TEMPLATE, hf_tokenizer_dir

        from prunus.models import HFTokenizer

        found.append(HFTokenizer(hf_tokenizer_dir(tmp_path_factory.mktemp("tok") / "tok", CHAT_TEMPLATE)))
    except ImportError:
        pass
    return found


def test_fuzz_jsonl_rows(tmp_path, tokenizers):
    path = tmp_path / "rows.jsonl"
    for i, rng in _budget():
        rows = [rng.choice(ROWS) for _ in range(rng.randint(1, 4))]
        lines = [json.dumps(r).encode() for r in rows]
        for _ in range(rng.choice([1, 1, 2])):
            j = rng.randrange(len(lines))
            lines[j] = _line_bytes(_mutate_row(rows[j], rng), rng)
        path.write_bytes(b"\n".join(lines) + rng.choice([b"\n", b"", b"\r\n"]))
        tokenizer = tokenizers[i % len(tokenizers)]
        case = f"JSONL case {i} with {type(tokenizer).__name__} ({b'|'.join(x[:120] for x in lines)!r})"
        _expect_one_line(lambda: load_documents(path, tokenizer, vocab_size=1 << 20), case)
    assert i > 10, "the budget ran out before the fuzzer got going"


# --- what the fuzzer found, kept as fixed cases ----------------------------------------------------------

def _edit_header(edit):
    def apply(header: dict) -> None:
        edit(header, next(k for k in header if k.startswith("layers.0.attention.wq")))
    return apply


FOUND = [  # (what, edit of the header dict or of config["model"], words of the one line)
    ("metadata not a mapping", "header", lambda h: h.__setitem__("__metadata__", "I8"), "__metadata__ 'I8' is not a mapping"),
    ("metadata of numbers", "header", lambda h: h.__setitem__("__metadata__", {"a": 1}), "is not a mapping of strings"),
    ("dtype a list", "header", _edit_header(lambda h, k: h[k].__setitem__("dtype", ["F32"])), "has no known dtype"),
    ("name a lone surrogate", "header", lambda h: h.__setitem__("\udc80", h.pop("norm.weight")), "is not UTF-8 text"),
    ("offsets overlap", "header", _edit_header(lambda h, k: h[k].__setitem__("data_offsets", [0, 16384])),
     "(a gap or an overlap)"),
    ("int32 for a float weight", "header", _edit_header(lambda h, k: h[k].__setitem__("dtype", "I32")),
     "is stored as I32 but the module holds float32 there"),
    ("2**53 + 1 experts", "config", lambda m: m.update(n_experts=2**53 + 1), "n_experts=9007199254740993 is above 16,777,216"),
    ("a billion layers", "config", lambda m: m.update(n_layers=10**9), "is above 16,777,216"),
    ("three layers of one", "config", lambda m: m.update(n_layers=3), "n_layers is 3 but the weights hold layers 0..0"),
    ("rope_theta 2**64", "config", lambda m: m.update(rope_theta=2**64), "rope_theta=18446744073709551616 must be a finite"),
]


@pytest.mark.parametrize("kind, edit, words", [f[1:] for f in FOUND], ids=[f[0] for f in FOUND])
def test_found_cases(model_dir, tmp_path, kind, edit, words):
    d = _copy_dir(model_dir, tmp_path / "m")
    if kind == "header":
        header, data = _split_safetensors(d / "model.safetensors")
        edit(header)
        body = json.dumps(header).encode()
        (d / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body + data)
    else:
        config = json.loads((d / "config.json").read_text())
        edit(config["model"])
        (d / "config.json").write_text(json.dumps(config))
    start = time.monotonic()
    with pytest.raises(PrunusError) as e:
        load_model(d, verify=False)
    assert words in str(e.value) and "\n" not in str(e.value) and time.monotonic() - start < 5
