"""GGUF interop: prunus -> GGUF -> prunus is bit-exact at f32, transformers reads our GGUF with the same
logits, quantized GGUF tensor types are dequantized within their error bound, bad input is one line."""

import inspect
import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import gguf
from gguf.quants import dequantize, quantize
from prunus.cli.main import cli
from prunus.models import ByteTokenizer, HFTokenizer, ModelConfig, Transformer, load_model, load_model_tokenizer, save_model
from prunus.models.gguf_read import from_gguf
from prunus.models.gguf_general import size_label
from prunus.models.gguf_write import to_gguf

CHAT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b  # 12345",
         "café naïve 日本語 🙂", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "  spaces   and\n\nlines "]
GQA = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=320, max_seq_len=128,
           rope_theta=50000.0, norm_eps=1e-5)


def make_tokenizer(directory, style="gpt-2"):
    """A byte-level BPE trained offline on a slice of the standard library (300 tokens, ChatML specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (byte_level if style == "gpt-2" else
                         pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]))
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([inspect.getsource(json)[:20000]], trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT}))
    return HFTokenizer(directory)


def make_model_dir(path, *, tie=False, tokenizer="gpt-2", **changes):
    """A tiny random Llama (norm weights randomised too, so a swap shows) saved as a prunus model dir."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**GQA, "tie_embeddings": tie, **changes}))
    model.init_weights(std=0.1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    tok = ByteTokenizer() if tokenizer == "byte" else make_tokenizer(path.parent / f"tok-{tokenizer}", tokenizer)
    return save_model(model.eval(), path, tokenizer=tok, stage="train")


def weights(path):
    return load_model(path).state_dict()


@pytest.mark.parametrize("tie,tokenizer", [(False, "gpt-2"), (True, "smollm"), (True, "byte")])
def test_f32_round_trip_is_bit_exact(tmp_path, tie, tokenizer):
    src = make_model_dir(tmp_path / "m", tie=tie, tokenizer=tokenizer)
    to_gguf(src, tmp_path / "m.gguf")
    back = from_gguf(tmp_path / "m.gguf", tmp_path / "back")
    a, b = weights(src), weights(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert load_model(back).config == load_model(src).config
    names = {t.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert ("output.weight" in names) == (not tie)  # llama.cpp reads a tied head from token_embd
    t0, t1 = load_model_tokenizer(src), load_model_tokenizer(back)
    assert type(t0) is type(t1) and t0.eos_id == t1.eos_id
    for text in TEXTS:
        assert t1.encode(text) == t0.encode(text)
        assert t1.decode(t1.encode(text)) == t0.decode(t0.encode(text))
    merges = gguf.GGUFReader(tmp_path / "m.gguf").fields.get("tokenizer.ggml.merges")
    assert merges is not None and len(merges.data) >= 1  # llama.cpp refuses a gpt2 vocabulary without merges
    if tokenizer != "byte":  # the byte vocabulary's one placeholder merge still reads back as the byte tokenizer
        cfg = json.loads((back / "tokenizer_config.json").read_text())
        assert cfg["chat_template"] == CHAT and cfg["eos_token"] == "<|im_end|>" and cfg["bos_token"] == "<|im_start|>"


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_f16_and_q8_0_are_within_their_rounding(tmp_path, kind):
    src = make_model_dir(tmp_path / "m")
    to_gguf(src, tmp_path / "m.gguf", type=kind)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.0.attn_q.weight"] == kind.upper()
    a, b = weights(src), weights(from_gguf(tmp_path / "m.gguf", tmp_path / "back"))
    for k in a:
        err = (a[k] - b[k]).abs()
        if a[k].ndim == 1:
            assert torch.equal(a[k], b[k]), k
        elif kind == "f16":  # half precision: 11 significant bits
            assert (err <= a[k].abs() * 2.0**-11 + 1e-7).all(), k
        else:  # 8-bit blocks of 32, step d = amax / 127: half a step, plus 127 * the fp16 rounding of d (2^-11 d)
            amax = a[k].abs().reshape(a[k].shape[0], -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(a[k].shape)
            assert (err <= amax / 127 * (0.5 + 127 * 2.0**-11)).all(), k



def _blocks(t: torch.Tensor, f) -> torch.Tensor:
    """``f`` of each block of 32 along the rows, spread back over the block's columns."""
    return f(t.reshape(t.shape[0], -1, 32)).expand(-1, -1, 32).reshape(t.shape)


@pytest.mark.parametrize("kind,tie", [("q4_0", True), ("q4_1", False)])
def test_q4_round_trip_is_within_the_block_error(tmp_path, kind, tie):
    src = make_model_dir(tmp_path / "m", tie=tie)
    to_gguf(src, tmp_path / "m.gguf", type=kind)
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    types = {t.name: t.tensor_type.name for t in r.tensors}
    head = "token_embd.weight" if tie else "output.weight"
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == kind.upper()
    assert types[head] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"  # the head as llama-quantize keeps it
    assert r.fields["general.file_type"].contents() == {"q4_0": 2, "q4_1": 3}[kind]
    a, b = weights(src), weights(from_gguf(tmp_path / "m.gguf", tmp_path / "back"))
    for k in a:
        err = (a[k] - b[k]).abs()
        if a[k].ndim == 1:
            assert torch.equal(a[k], b[k]), k
        elif k == head.replace("token_embd", "tok_embeddings") or k == "output.weight":
            amax = _blocks(a[k], lambda g: g.abs().amax(-1, keepdim=True))
            assert (err <= amax / 127 * (0.5 + 127 * 2.0**-11)).all(), k
        elif kind == "q4_0":  # d = -amax / 8: half a step, a whole one at +amax's mirror (clipped to 7), fp16 d
            amax = _blocks(a[k], lambda g: g.abs().amax(-1, keepdim=True))
            assert (err <= amax / 8 + amax * 2.0**-11).all(), k
            assert err.mean() < (amax / 16).mean(), k
        else:  # d = (max - min) / 15 from m = min: half a step, plus fp16 rounding of d (times 15) and of m
            lo, hi = _blocks(a[k], lambda g: g.amin(-1, keepdim=True)), _blocks(a[k], lambda g: g.amax(-1, keepdim=True))
            assert (err <= (hi - lo) / 30 + ((hi - lo) + lo.abs()) * 2.0**-10).all(), k


def test_q4_rows_not_in_blocks_of_32_fall_back_to_f16(tmp_path):
    src = make_model_dir(tmp_path / "m", dim=48, n_heads=4, n_kv_heads=2, tie=True)
    to_gguf(src, tmp_path / "m.gguf", type="q4_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == "F16"  # 48 columns
    assert types["blk.0.ffn_down.weight"] == "Q4_0"  # 128 columns


def _int4_dir(src, out, *, symmetric: bool, group_size: int = 32, mantissa_bits: int = 10):
    """``src`` compressed to stored int4 (RTN), its scales rounded to fp16 values so GGUF holds them exactly (to
    ``mantissa_bits`` of fp16's 10: with 6, every offset -z s of a zero point below 16 is an fp16 value too)."""
    from prunus.compress.quantize import quantize_pass

    model = quantize_pass(load_model(src), None, scheme="int4-weight-only", group_size=group_size, symmetric=symmetric)
    for m in model.modules():
        if hasattr(m, "weight_scale") and m.weight_scale is not None and m.weight_scale.dtype == torch.float32:
            mant, exp = torch.frexp(m.weight_scale)
            m.weight_scale = torch.ldexp(torch.round(mant * 2.0 ** (mantissa_bits + 1)) / 2.0 ** (mantissa_bits + 1),
                                         exp).half().float()
    return save_model(model, out, tokenizer=load_model_tokenizer(src), stage="compress", parent=src)


def _types(path) -> dict:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("kind,symmetric,bits", [("q4_0", True, 10), ("q4_1", False, 6), ("q4_1", True, 10),
                                                ("q4_0", False, 6), ("q4_1", False, 10)])
@pytest.mark.parametrize("group", [32, 64])
def test_stored_int4_values_are_written_exactly(tmp_path, kind, symmetric, bits, group):
    """Stored int4 codes go into Q4_0 (symmetric) or Q4_1 blocks as they are, whatever --type names, groups of 64
    as two blocks; a tensor whose offsets -z s are no fp16 values (scales of 10 mantissa bits) stays F32. Every
    weight reads back exactly, and the file's model gives the dir's logits."""
    src = make_model_dir(tmp_path / "m", tie=True)
    qdir = _int4_dir(src, tmp_path / "q", symmetric=symmetric, group_size=group, mantissa_bits=bits)
    to_gguf(qdir, tmp_path / "q.gguf", type=kind)
    types = _types(tmp_path / "q.gguf")
    back = load_model(from_gguf(tmp_path / "q.gguf", tmp_path / "back"))
    q = load_model(qdir)
    for i in range(2):
        for name, gname in [("attention.wq", "attn_q"), ("attention.wk", "attn_k"), ("feed_forward.w2", "ffn_down")]:
            m = q.get_submodule(f"layers.{i}.{name}")
            assert torch.equal(back.state_dict()[f"layers.{i}.{name}.weight"], m.dequantize()), name
            assert types[f"blk.{i}.{gname}.weight"] == ("Q4_0" if symmetric else "Q4_1" if bits == 6 else "F32")
    assert types["token_embd.weight"] == "F32"  # the float (tied) embedding is not quantized again
    tokens = torch.randint(0, GQA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(tokens).argmax(-1), q(tokens).argmax(-1))
        assert (back(tokens) - q(tokens)).abs().max() < 1e-4


@pytest.mark.parametrize("fp16_scales", [True, False])
def test_stored_int8_values_are_written_exactly(tmp_path, fp16_scales):
    """int8 per-channel codes go into Q8_0 blocks when their scales are fp16 values, else F32 (exact either way);
    the float head stays F32; the size label counts parameters."""
    from prunus.compress.quantize import quantize_pass

    src = make_model_dir(tmp_path / "m")
    model = quantize_pass(load_model(src), None, scheme="int8-weight-only")
    if fp16_scales:
        for m in model.modules():
            if getattr(m, "weight_scale", None) is not None:
                m.weight_scale = m.weight_scale.half().float()
    qdir = save_model(model, tmp_path / "q", tokenizer=load_model_tokenizer(src), stage="compress", parent=src)
    to_gguf(qdir, tmp_path / "q.gguf", type="q4_0")
    types = _types(tmp_path / "q.gguf")
    assert types["blk.1.ffn_gate.weight"] == ("Q8_0" if fp16_scales else "F32")
    assert types["output.weight"] == types["token_embd.weight"] == "F32"
    back = load_model(from_gguf(tmp_path / "q.gguf", tmp_path / "back"))
    q = load_model(qdir)
    assert torch.equal(back.state_dict()["layers.1.feed_forward.w1.weight"], q.layers["1"].feed_forward.w1.dequantize())
    tokens = torch.randint(0, GQA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(tokens).argmax(-1), q(tokens).argmax(-1))
    reader = gguf.GGUFReader(tmp_path / "q.gguf")
    label = bytes(reader.fields["general.size_label"].parts[-1]).decode()
    n = sum(p.numel() for p in load_model(src).parameters())
    assert label == size_label(n)


@pytest.mark.parametrize("source", ["fp32", "int4"])
def test_transformers_reads_our_q4_0_gguf_with_prunus_logits(tmp_path, source):
    """transformers dequantizes the Q4_0 blocks itself; its logits are prunus's on the dequantized weights.
    For an int4 dir that is the dir's own int4 model: its fp16-exact scales go into Q4_0 as they are, and its
    float (tied) embedding stays F32."""
    transformers = pytest.importorskip("transformers")
    src = make_model_dir(tmp_path / "m", tie=True)
    qdir = _int4_dir(src, tmp_path / "q", symmetric=True) if source == "int4" else None
    to_gguf(qdir or src, tmp_path / "q4.gguf", type="q4_0")
    back = load_model(from_gguf(tmp_path / "q4.gguf", tmp_path / "back"))
    ours = back if qdir is None else load_model(qdir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="q4.gguf", dtype=torch.float32).eval()
    tokens = torch.randint(0, GQA["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max() < 1e-5

FAMILIES = {"llama": {}, "qwen2": dict(attn_qkv_bias=True), "qwen3": dict(qk_norm=True, head_dim=32),
            "llama-bias": dict(attn_qkv_bias=True, attn_out_bias=True), "llama-linear-rope": dict(rope_type="linear", rope_factor=2.0)}


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama-bias", "llama-linear-rope"])
def test_families_round_trip_bit_exact(tmp_path, family):
    src = make_model_dir(tmp_path / "m", n_layers=1, **FAMILIES[family])
    to_gguf(src, tmp_path / "m.gguf", type="f32")
    arch = gguf.GGUFReader(tmp_path / "m.gguf").fields["general.architecture"].contents()
    assert arch == family.split("-")[0]
    back = from_gguf(tmp_path / "m.gguf", tmp_path / "back")
    a, b = weights(src), weights(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert load_model(back).config == load_model(src).config


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_transformers_reads_our_gguf_with_the_same_logits(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    # transformers reads no attention.key_length for qwen3 and takes Qwen3Config's head_dim, 128
    src = make_model_dir(tmp_path / "m", **{**FAMILIES[family], **({"head_dim": 128} if family == "qwen3" else {})})
    to_gguf(src, tmp_path / "m.gguf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    tokens = torch.randint(0, GQA["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(tokens).logits - load_model(src)(tokens)).abs().max() < 1e-5
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    ours = load_model_tokenizer(src)
    for text in TEXTS:
        assert hf_tok.encode(text, add_special_tokens=False) == ours.encode(text)


def _rewrite(src, dst, *, arch=None, types=None):
    """Copy a GGUF, optionally under another architecture name or with some tensors stored as other types."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch or r.fields["general.architecture"].contents())
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name.replace("llama.", f"{arch}.", 1) if arch else name, field.contents(), field.types[0], sub)
    for t in r.tensors:
        data = dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed([int(n) for n in t.shape])))
        kind = (types or {}).get(t.name)
        if kind == "F64":
            w.add_tensor(t.name, data.astype(np.float64))
        elif kind is not None:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(t.name, quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_gguf_tensors_are_dequantized(tmp_path, kind):
    src = make_model_dir(tmp_path / "m", n_layers=1)
    to_gguf(src, tmp_path / "m.gguf")
    names = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight", "token_embd.weight"]
    _rewrite(tmp_path / "m.gguf", tmp_path / "q.gguf", types=dict.fromkeys(names, kind))
    back = from_gguf(tmp_path / "q.gguf", tmp_path / "back", dtype="bfloat16")
    a, b = weights(src), weights(back)
    assert load_model(back).config.dtype == "bfloat16" and b["norm.weight"].dtype == torch.bfloat16
    bits = {"BF16": 8, "Q8_0": 7, "Q5_0": 4, "Q5_1": 4, "Q4_0": 3, "Q4_1": 3}[kind]
    for k in ("layers.0.attention.wq.weight", "layers.0.attention.wk.weight", "layers.0.feed_forward.w2.weight"):
        rel = (a[k] - b[k].float()).abs().max() / a[k].abs().max()
        assert rel < 2.0 ** -bits + 2.0**-8, (k, rel)  # the type's step, plus bfloat16 output rounding


def test_quantized_prunus_dir_is_written_dequantized(tmp_path):
    from prunus.compress.quantize import quantize_pass

    src = make_model_dir(tmp_path / "m")
    model = quantize_pass(load_model(src), None, scheme="int8-weight-only")
    qdir = save_model(model, tmp_path / "q", tokenizer=load_model_tokenizer(src), stage="compress", parent=src)
    to_gguf(qdir, tmp_path / "q.gguf")
    back = weights(from_gguf(tmp_path / "q.gguf", tmp_path / "back"))
    q = load_model(qdir)
    assert torch.equal(back["layers.1.feed_forward.w1.weight"], q.layers["1"].feed_forward.w1.dequantize())
    assert torch.equal(back["output.weight"], q.output.weight)  # excluded from quantization: exact


def _user_error(result, *needles):
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    src = make_model_dir(tmp / "m", n_layers=1)
    return to_gguf(src, tmp / "m.gguf"), src


def test_bad_gguf_input_is_one_line_and_writes_nothing(tmp_path, good_gguf):
    path, _ = good_gguf
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    (tmp_path / "head.gguf").write_bytes(data[:40])
    (tmp_path / "text.gguf").write_text("hello, not a model\n")
    _rewrite(path, tmp_path / "falcon.gguf", arch="falcon")
    _rewrite(path, tmp_path / "f64.gguf", types={"blk.0.attn_q.weight": "F64"})
    runner = CliRunner()
    cases = {"cut.gguf": "truncated", "head.gguf": "truncated", "text.gguf": "not a GGUF file",
             "falcon.gguf": "'falcon' is not supported", "f64.gguf": "type F64", "missing.gguf": "no such file"}
    for name, needle in cases.items():
        out = tmp_path / f"out-{name}"
        _user_error(runner.invoke(cli, ["convert", "--from-gguf", str(tmp_path / name), "--out", str(out)]), needle)
        assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_out_must_not_be_the_input(tmp_path, good_gguf):
    path, src = good_gguf
    runner = CliRunner()
    before = path.read_bytes()
    _user_error(runner.invoke(cli, ["convert", "--from-gguf", str(path), "--out", str(path), "--overwrite"]), "input")
    _user_error(runner.invoke(cli, ["convert", "--from-gguf", str(path), "--out", str(path.parent), "--overwrite"]), "input")
    assert path.read_bytes() == before
    files = sorted(os.listdir(src))
    _user_error(runner.invoke(cli, ["convert", "--to-gguf", str(src), "--out", str(src), "--overwrite"]), "input")
    _user_error(runner.invoke(cli, ["convert", "--to-gguf", str(src), "--out", str(src / "m.gguf")]), "input")
    assert sorted(os.listdir(src)) == files
    _user_error(runner.invoke(cli, ["convert", "--to-gguf", str(src), "--out", str(tmp_path / "x.gguf"), "--dtype",
                                    "float16"]), "--dtype applies to --from-gguf only")


def test_cli_round_trip(tmp_path, good_gguf):
    path, src = good_gguf
    runner = CliRunner()
    for kind in ("q8_0", "q4_0"):
        r = runner.invoke(cli, ["convert", "--to-gguf", str(src), "--out", str(tmp_path / f"{kind}.gguf"), "--type", kind])
        assert r.exit_code == 0, r.output
        assert f"tensors {kind.upper()} x " in r.output and "F32 x " in r.output  # the types written, counted
        r = runner.invoke(cli, ["convert", "--from-gguf", str(tmp_path / f"{kind}.gguf"), "--out", str(tmp_path / kind)])
        assert r.exit_code == 0 and "wrote" in r.output, r.output
        assert load_model(tmp_path / kind).config == load_model(src).config


def make_sentencepiece_tokenizer(directory):
    """A SentencePiece-style BPE (Metaspace, byte fallback, <0xNN> tokens) whose merges follow token scores,
    as Hugging Face's converter of a SentencePiece model writes them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from prunus.models.gguf_tokenizer import generate_merges

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    trained.train_from_iterator([inspect.getsource(json)[:20000]],
                                trainers.BpeTrainer(vocab_size=200, show_progress=False))
    pieces = sorted(trained.get_vocab().items(), key=lambda kv: kv[1])
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece, _ in pieces:
        vocab.setdefault(piece, len(vocab))
    merges = generate_merges(vocab, {t: -float(i) for t, i in vocab.items() if i > 258})
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "chat_template": CHAT}))
    return HFTokenizer(directory), len(vocab)


def test_sentencepiece_tokenizer_round_trips_and_matches_transformers(tmp_path):
    tok, n = make_sentencepiece_tokenizer(tmp_path / "spm")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**GQA, "vocab_size": n + 3}))
    src = save_model(model.eval(), tmp_path / "m", tokenizer=tok, stage="train")
    to_gguf(src, tmp_path / "m.gguf")
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert fields["tokenizer.ggml.model"].contents() == "llama" and "tokenizer.ggml.scores" in fields
    back = load_model_tokenizer(from_gguf(tmp_path / "m.gguf", tmp_path / "back"))
    texts = TEXTS[:3] + ["Ünïcödé ✓ and rare bytes \x07"]
    for text in texts:
        assert back.encode(text) == tok.encode(text), text
        assert back.decode(back.encode(text)) == tok.decode(tok.encode(text))
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in texts:
        assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text), text


@pytest.mark.parametrize("passes", [
    {"scheme": "int8-weight-only"},
    {"scheme": "int8-weight-only", "granularity": "per_group", "group_size": 32},
    {"scheme": "int4-weight-only", "group_size": 32, "symmetric": True, "int8": ["output"], "exclude": []},
    {"scheme": "int4-weight-only", "algorithm": "hqq", "group_size": 64, "symmetric": False, "int8": ["output"],
     "exclude": []},
], ids=["int8-channel", "int8-g32", "int4-sym-g32", "int4-hqq-g64"])
def test_gguf_scales_put_every_stored_weight_into_blocks_exactly(tmp_path, passes):
    """A quantize pass with ``gguf_scales: true`` leaves scales GGUF's Q8_0 / Q4_0 / Q4_1 hold as they are: every
    stored Linear is written as blocks (none falls back to F32), each reads back as the very weights the dir
    holds, and the file's model gives the dir's argmax. The rounding moves the logits little."""
    from prunus.compress.quantize import quantize_pass

    src = make_model_dir(tmp_path / "m", tie=True)
    plain = quantize_pass(load_model(src), None, **passes)
    model = quantize_pass(load_model(src), None, gguf_scales=True, **passes)
    qdir = save_model(model, tmp_path / "q", tokenizer=load_model_tokenizer(src), stage="compress", parent=src)
    to_gguf(qdir, tmp_path / "q.gguf", type="q8_0")
    types = _types(tmp_path / "q.gguf")
    stored = {n: t for n, t in types.items() if n.startswith("blk.") and "norm" not in n or n == "output.weight"}
    assert stored and all(t in ("Q8_0", "Q4_0", "Q4_1") for t in stored.values()), stored
    q, back = load_model(qdir), load_model(from_gguf(tmp_path / "q.gguf", tmp_path / "back"))
    for name, m in q.named_modules():
        if hasattr(m, "dequantize"):
            assert torch.equal(back.state_dict()[f"{name}.weight"], m.dequantize()), name
    assert json.loads((qdir / "config.json").read_text())["compression"]["quantization"]["gguf_scales"] is True
    tokens = torch.randint(0, GQA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(tokens).argmax(-1), q(tokens).argmax(-1))
        quantized = (plain(tokens) - load_model(src)(tokens)).abs().max()  # what quantizing moved the logits
        assert (q(tokens) - plain(tokens)).abs().max() < 0.3 * quantized  # scales moved by 2^-8 of themselves at most


def test_gguf_scales_refuses_what_no_block_holds(tmp_path):
    from prunus.artifacts.errors import PrunusError
    from prunus.compress.quantize import quantize_pass

    src = make_model_dir(tmp_path / "m")
    with pytest.raises(PrunusError, match="gguf_scales needs integer zero points"):
        quantize_pass(load_model(src), None, scheme="int4-weight-only", symmetric=False, float_zero=True,
                      gguf_scales=True)
    with pytest.raises(PrunusError, match="gguf_scales is for int8 and int4"):
        quantize_pass(load_model(src), None, scheme="fp8-weight-only", gguf_scales=True)
