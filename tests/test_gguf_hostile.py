"""Hostile GGUF files: every count, length, offset, type and value a file states is checked before it is
used, so each corrupt or crafted file below is one ``Error:`` line naming the file (exit 2), quickly, with
nothing written. Valid tiny files come from ``gguf.GGUFWriter`` (tests/gguf_craft.py); each case corrupts
one field of one, or states a header that claims far more than the file holds."""

import struct
import time

import numpy as np
import pytest
from click.testing import CliRunner

from gguf_craft import DIM, NAME, VOCAB, V, gguf_string, layout, patched, raw_header, tiny_metadata, write_tiny
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.gguf_header import MAX_ITEMS, MAX_KEYS, read_gguf_header
from prunus.cli.main import cli
from prunus.models import load_model
from prunus.models.gguf_read import from_gguf


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """A valid tiny GGUF (converted once, which also imports everything the timed refusals use) and its bytes."""
    tmp = tmp_path_factory.mktemp("valid")
    path = write_tiny(tmp / "valid.gguf")
    from_gguf(path, tmp / "out")
    assert load_model(tmp / "out").config.dim == DIM
    return path, path.read_bytes()


@pytest.fixture
def refuse(tmp_path, assert_user_error, valid):
    """``refuse(data_or_path, *needles)``: prunus convert fails in one line naming the file and every needle,
    exit 2, in under a second (milliseconds, unloaded), writing nothing."""
    runner = CliRunner()
    runner.invoke(cli, ["convert", "--from-gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "out")])

    def check(source, *needles, seconds: float = 1.0):
        path = source
        if isinstance(source, bytes):
            path = tmp_path / "hostile.gguf"
            path.write_bytes(source)
        out = tmp_path / "out"
        start = time.perf_counter()
        result = runner.invoke(cli, ["convert", "--from-gguf", str(path), "--out", str(out)])
        elapsed = time.perf_counter() - start
        assert_user_error(result, str(path), *needles)
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".") or ".tmp" in p.name]
        assert elapsed < seconds, (elapsed, result.stderr)
        return result.stderr

    return check


# --------------------------------------------------------------------------- counts and lengths bounded by the file


def test_a_20_million_item_array_is_refused_before_it_is_read(refuse):
    tokens = gguf_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 20_000_000) + gguf_string("a") * 4
    refuse(raw_header(0, 1, tokens), "item count of metadata 'tokenizer.ggml.tokens' is 20,000,000")
    numbers = gguf_string("llama.junk") + struct.pack("<IIQ", 9, 4, 20_000_000) + bytes(64)
    refuse(raw_header(0, 1, numbers), "20,000,000", "bytes left hold at most 16")


def test_an_array_above_the_ceiling_is_refused_even_when_its_bytes_are_there(refuse):
    n = MAX_ITEMS + 1
    body = gguf_string("llama.junk") + struct.pack("<IIQ", 9, 0, n) + bytes(n)
    refuse(raw_header(0, 1, body), f"is {n:,}", f"at most {MAX_ITEMS:,} are read")


def test_200_000_keys_and_a_huge_tensor_count_are_refused_at_once(refuse):
    refuse(raw_header(0, 200_000, bytes(200_000 * 13)), "metadata key count is 200,000", f"at most {MAX_KEYS:,}")
    refuse(raw_header(0, 2**63, bytes(64)), "metadata key count")
    refuse(raw_header(2**64 - 1, 0, bytes(64)), "tensor count")


def test_lengths_beyond_the_file_are_refused(refuse, valid):
    _, data = valid
    where = layout(data)
    key_len, _, _, count_pos = where["kv"]["tokenizer.ggml.tokens"]
    refuse(patched(data, key_len, "Q", 2**63), "the length of metadata key")
    refuse(patched(data, count_pos, "Q", 2**64 - 1), "item count of metadata 'tokenizer.ggml.tokens'")
    refuse(patched(data, count_pos + 8, "Q", 2**40), "'tokenizer.ggml.tokens' item 0 of 1099511627776 bytes")
    refuse(patched(data, where["tensors"]["output.weight"]["name_len"], "Q", 10**12), "the name of tensor")
    refuse(data[:where["end"] - 3], "truncated or corrupt")


# --------------------------------------------------------------------------- the header's format


def test_versions_value_types_and_duplicates(refuse, valid):
    _, data = valid
    where = layout(data)
    refuse(patched(data, 4, "I", 1), "GGUF version 1")
    refuse(data[:4] + struct.pack(">I", 3) + data[8:], "big-endian")
    _, type_pos, _ = where["kv"]["general.name"]
    refuse(patched(data, type_pos, "I", 13), "metadata 'general.name' has value type 13")
    nested = gguf_string("llama.junk") + struct.pack("<IIQ", 9, 9, 1)
    refuse(raw_header(0, 1, nested + bytes(32)), "arrays of arrays")
    twice = (gguf_string("general.name") + struct.pack("<I", 8) + gguf_string("x")) * 2
    refuse(raw_header(0, 2, twice), "metadata 'general.name' is given twice")
    align = gguf_string("general.alignment") + struct.pack("<II", 4, 24)
    refuse(raw_header(0, 1, align), "general.alignment=24 is not a power of two")


def test_tensor_entries(refuse, valid):
    _, data = valid
    t = layout(data)["tensors"]
    refuse(patched(data, t["output_norm.weight"]["n_dims"], "I", 5), "'output_norm.weight' has 5 dimensions")
    refuse(patched(data, t["output_norm.weight"]["type"], "I", 99), "tensor type id 99")
    refuse(patched(data, t["output_norm.weight"]["type"], "I", 12), "not whole Q4_K blocks of 256")  # 32 values
    refuse(patched(data, t["output_norm.weight"]["dims"], "Q", 0), "every dimension at least 1")
    refuse(patched(data, t["output.weight"]["offset"], "Q", read_offset(data, t["output.weight"]) + 4),
           "not a multiple of the alignment")


def read_offset(data: bytes, entry: dict) -> int:
    return struct.unpack_from("<Q", data, entry["offset"])[0]


# --------------------------------------------------------------------------- tensor data: inside, apart, matching


def test_an_offset_that_wraps_past_2_64_is_not_inside_the_file(refuse, valid):
    _, data = valid
    where = layout(data)
    data_start = -(-where["end"] // 32) * 32
    wrapped = 2**64 - data_start  # data_start + offset is 2^64: 0 modulo 2^64, the first byte of the header
    refuse(patched(data, where["tensors"]["token_embd.weight"]["offset"], "Q", wrapped), "ends past the end")
    refuse(patched(data, where["tensors"]["output.weight"]["offset"], "Q", 2**64 - 32), "ends past the end")


def test_overlapping_tensors_are_refused(refuse, valid):
    _, data = valid
    t = layout(data)["tensors"]
    same = patched(data, t["output.weight"]["offset"], "Q", read_offset(data, t["token_embd.weight"]))
    refuse(same, "share bytes")
    inside = patched(data, t["output_norm.weight"]["offset"], "Q", read_offset(data, t["token_embd.weight"]) + 64)
    refuse(inside, "share bytes")


def test_data_that_does_not_match_its_type_and_shape_is_refused(refuse, valid):
    _, data = valid
    t = layout(data)["tensors"]
    refuse(patched(data, t["output_norm.weight"]["dims"], "Q", DIM * 2), "share bytes")  # more bytes than it has
    refuse(patched(data, t["output_norm.weight"]["type"], "I", 1), "belong to no tensor")  # F16: half its bytes
    refuse(patched(data, t["token_embd.weight"]["type"], "I", 30), "belong to no tensor")  # BF16


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_weights_are_refused(tmp_path, refuse, bad):
    w = np.full((DIM, DIM), 0.01, dtype=np.float32)
    w[3, 5] = bad
    refuse(write_tiny(tmp_path / "f32.gguf", tensors={"blk.0.attn_q.weight": w}), "blk.0.attn_q.weight", "NaN or infinite")
    refuse(write_tiny(tmp_path / "f16.gguf", tensors={"blk.0.attn_q.weight": w.astype(np.float16)}), "NaN or infinite")


# --------------------------------------------------------------------------- strings and metadata values


def test_strings_that_are_not_utf8_name_the_key(refuse, valid):
    _, data = valid
    refuse(data.replace(NAME.encode(), b"prunus-t\xffny"), "metadata 'general.name' is not UTF-8")
    refuse(data.replace(b"llama.context_length", b"llama.c\xffntext_length"), "metadata key 3 is not UTF-8")
    refuse(data.replace(b"output_norm.weight", b"output_n\xffrm.weight"), "the name of tensor 1 is not UTF-8")
    token = "\u0100".encode()  # the byte symbol of byte 0, the vocabulary's first token
    refuse(data.replace(token, b"\xff\xff", 1), "metadata 'tokenizer.ggml.tokens' item 0 is not UTF-8")


@pytest.mark.parametrize("key,value,needle", [
    ("llama.attention.head_count", (0, V.UINT32), "metadata llama.attention.head_count 0 must be an integer from 1"),
    ("llama.attention.head_count", ("2", V.STRING), "llama.attention.head_count '2' must be an integer"),
    ("llama.attention.head_count_kv", (3, V.UINT32), "not divisible by n_kv_heads=3"),
    ("llama.embedding_length", (-4, V.INT32), "llama.embedding_length -4 must be an integer"),
    ("llama.block_count", (10**9, V.UINT32), "llama.block_count 1000000000 must be an integer from 1 to 65536"),
    ("llama.block_count", (2, V.UINT32), "llama.block_count=2 but the file holds tensors of 1 layer"),
    ("llama.block_count", None, "missing metadata llama.block_count"),
    ("llama.context_length", (2**40, V.UINT64), "llama.context_length"),
    ("llama.rope.freq_base", (float("nan"), V.FLOAT32), "llama.rope.freq_base=nan must be a positive finite"),
    ("llama.attention.layer_norm_rms_epsilon", (True, V.BOOL), "layer_norm_rms_epsilon=True must be a positive"),
    ("llama.attention.key_length", (64, V.UINT32), "has shape [32, 32] but the metadata gives [128, 32]"),
    ("llama.rope.dimension_count", (8, V.UINT32), "llama.rope.dimension_count=8 differs from the head size 16"),
    ("llama.embedding_length", (4096, V.UINT32), "'token_embd.weight' has shape [260, 32] but the metadata gives [260, 4096]"),
    ("llama.feed_forward_length", (10**9, V.UINT32), "ffn_dim=1000000000 is above"),
    ("llama.feed_forward_length", (4096, V.UINT32), "'blk.0.ffn_gate.weight' has shape [64, 32]"),
    ("llama.vocab_size", (10**6, V.UINT32), "llama.vocab_size=1000000 but token_embd.weight has 260 rows"),
    ("general.architecture", ([1, 2], V.ARRAY, V.INT32), "general.architecture=[1, 2] is not supported"),
    ("general.alignment", (0, V.UINT32), "general.alignment=0 is not a power of two"),
])
def test_model_metadata_is_typed_and_checked_against_the_tensors(tmp_path, refuse, key, value, needle):
    refuse(write_tiny(tmp_path / "m.gguf", meta={key: value}), needle)


def test_a_one_dimensional_embedding_and_missing_or_extra_tensors(tmp_path, refuse):
    refuse(write_tiny(tmp_path / "a.gguf", tensors={"token_embd.weight": np.zeros(VOCAB * DIM, np.float32)}),
           "token_embd.weight has shape [8320]; an embedding has 2 dimensions")
    refuse(write_tiny(tmp_path / "b.gguf", tensors={"blk.0.ffn_up.weight": None}), "blk.0.ffn_up.weight missing")
    refuse(write_tiny(tmp_path / "c.gguf", tensors={"blk.0.ffn_norm.weight": np.ones((2, DIM), np.float32)}),
           "'blk.0.ffn_norm.weight' has shape [2, 32] but the metadata gives [32]")
    refuse(write_tiny(tmp_path / "d.gguf", tensors={"blk.0.weird.weight": np.ones(DIM, np.float32)}),
           "'blk.0.weird.weight' are not part of")
    far = f"blk.{'9' * 200}.ffn_norm.weight"
    refuse(write_tiny(tmp_path / "e.gguf", tensors={far: np.ones(DIM, np.float32)}), "but the file holds tensors of 1")
    refuse(write_tiny(tmp_path / "f.gguf", tensors={far.replace("9", "99"): np.ones(DIM, np.float32)}),
           "the length of the name of tensor 12 is 420, but at most 256 are read")


def test_rotary_tables_are_bounded_by_the_file(tmp_path, refuse):
    meta = {"llama.context_length": (1 << 20, V.UINT32), "llama.attention.key_length": (1 << 10, V.UINT32)}
    refuse(write_tiny(tmp_path / "m.gguf", meta=meta), "context_length=1048576 with heads of 1024 needs 8,192 MiB "
           "of rotary tables, above the 256 MiB")


# --------------------------------------------------------------------------- the tokenizer


def _tokens(n: int) -> dict:
    meta = tiny_metadata()
    return {"tokenizer.ggml.tokens": (meta["tokenizer.ggml.tokens"][0][:n], V.ARRAY, V.STRING),
            "tokenizer.ggml.token_type": (meta["tokenizer.ggml.token_type"][0][:n], V.ARRAY, V.INT32)}


@pytest.mark.parametrize("meta,needle", [
    ({"tokenizer.ggml.eos_token_id": ("</s>", V.STRING)}, "tokenizer.ggml.eos_token_id='</s>' must be an integer"),
    ({"tokenizer.ggml.eos_token_id": (10**6, V.UINT32)}, "eos_token_id=1000000 is not a token id of its 260-token"),
    ({"tokenizer.ggml.bos_token_id": (-1, V.INT32), "tokenizer.ggml.add_bos_token": (True, V.BOOL)}, "bos_token_id=-1"),
    ({"tokenizer.ggml.merges": (["zz qq"], V.ARRAY, V.STRING)}, "tokenizer.ggml.merges item 0 ('zz qq')"),
    ({"tokenizer.ggml.merges": (["\u0100\u0101"], V.ARRAY, V.STRING)}, "merges item 0"),
    ({"tokenizer.ggml.merges": (["\u0100 \u0101"], V.ARRAY, V.STRING)}, "does not join two tokens"),  # no "Āā" token
    ({"tokenizer.ggml.merges": ([1, 2], V.ARRAY, V.INT32)}, "tokenizer.ggml.merges=[1, 2] must be a list of text"),
    (_tokens(100), "eos_token_id=256 is not a token id of its 100-token vocabulary"),
    ({**_tokens(258), "tokenizer.ggml.eos_token_id": (1, V.UINT32)}, "merges item 0"),
    ({"tokenizer.ggml.token_type": ([1] * 10, V.ARRAY, V.INT32)}, "token_type has 10 items for 260 tokens"),
    ({"tokenizer.ggml.scores": ([0.0] * 3, V.ARRAY, V.FLOAT32)}, "scores has 3 items for 260 tokens"),
    ({"tokenizer.ggml.tokens": ([1, 2], V.ARRAY, V.INT32)}, "tokenizer.ggml.tokens=[1, 2] must be a list of text"),
    ({"tokenizer.ggml.model": (7, V.UINT32)}, "tokenizer.ggml.model=7 must be text"),
    ({"tokenizer.ggml.model": ("bert", V.STRING)}, "tokenizer.ggml.model='bert' is not supported"),
    ({"tokenizer.ggml.pre": ("nope", V.STRING), "tokenizer.ggml.eos_token_id": (1, V.UINT32)},
     "tokenizer.ggml.pre='nope'"),
    ({"tokenizer.ggml.model": None}, "no tokenizer.ggml.model"),
    ({"tokenizer.chat_template": ([1, 2], V.ARRAY, V.UINT8)}, "tokenizer.chat_template=[1, 2] must be text"),
    ({"tokenizer.ggml.add_bos_token": (1, V.UINT8)}, "tokenizer.ggml.add_bos_token=1 must be true or false"),
])
def test_tokenizer_metadata_is_typed_and_inside_the_vocabulary(tmp_path, refuse, meta, needle):
    refuse(write_tiny(tmp_path / "t.gguf", meta=meta), needle)


def test_a_huge_token_is_refused(tmp_path, refuse):
    tokens = tiny_metadata()["tokenizer.ggml.tokens"][0]
    meta = {"tokenizer.ggml.tokens": (tokens[:257] + ["x" * 5000] + tokens[258:], V.ARRAY, V.STRING)}
    refuse(write_tiny(tmp_path / "t.gguf", meta=meta), "tokens item 257 is 5,000 characters long")


def test_the_header_reader_is_the_python_api_too(tmp_path, valid):
    path, data = valid
    header = read_gguf_header(path)
    assert header.metadata["general.name"] == NAME and len(header.tensors) == 12
    assert header.tensors["token_embd.weight"].rows_shape == (VOCAB, DIM)
    (tmp_path / "cut.gguf").write_bytes(data[:30])
    with pytest.raises(PrunusError, match="truncated or corrupt") as e:
        read_gguf_header(tmp_path / "cut.gguf")
    assert "\n" not in str(e.value) and str(tmp_path / "cut.gguf") in str(e.value)
