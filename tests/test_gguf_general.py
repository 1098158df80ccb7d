"""GGUF metadata prunus writes: the llama.cpp pre-tokenizer name a tokenizer.json's pre-tokenizer
identifies, and the general.* names (from a model card, carried through --from-gguf)."""

import json

import pytest
import torch

import gguf
from prunus.artifacts.errors import PrunusError
from prunus.models import ModelConfig, Transformer, load_model_tokenizer, save_model
from prunus.models.gguf_general import size_label
from prunus.models.gguf_read import from_gguf
from prunus.models.gguf_tokenizer import pre_tokenizer_name
from prunus.models.gguf_write import to_gguf

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
# SmolLM2-135M's tokenizer.json pre_tokenizer, as published
SMOLLM2 = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL]}
# Llama 3's tokenizer.json pre_tokenizer, as published
LLAMA3 = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?"
                                           "[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


def test_pre_tokenizer_families():
    assert pre_tokenizer_name(SMOLLM2, "t.json") == "smollm"
    assert pre_tokenizer_name(LLAMA3, "t.json") == "llama-bpe"
    assert pre_tokenizer_name(BYTE_LEVEL, "t.json") == "gpt-2"
    assert pre_tokenizer_name({**SMOLLM2, "pretokenizers": [SMOLLM2["pretokenizers"][0],
                                                             {**BYTE_LEVEL, "trim_offsets": False}]}, "t.json") == "smollm"
    with pytest.raises(PrunusError) as e:  # an unknown split is refused, not written under a guessed name
        pre_tokenizer_name({"type": "Whitespace"}, "dir/tokenizer.json")
    assert "dir/tokenizer.json" in str(e.value) and "convert_hf_to_gguf.py" in str(e.value)
    assert "\n" not in str(e.value)


def test_size_label_as_llama_cpp_spells_it():
    assert [size_label(n) for n in (134515008, 1711376384, 360_000_000, 7_241_732_096, 52_000)] == \
        ["135M", "1.7B", "360M", "7.2B", "52K"]


def _tiny_dir(path):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=260,
                                    max_seq_len=64)).eval()
    from prunus.models import ByteTokenizer
    return save_model(model, path, tokenizer=ByteTokenizer(), stage="train")


def _general(path):
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("general.")}


def test_general_names_from_model_card_and_through_from_gguf(tmp_path):
    d = _tiny_dir(tmp_path / "Tiny-Demo")
    (d / "README.md").write_text("---\nlicense: apache-2.0\nlanguage:\n- en\n- fr\ntags: [x]\n---\n# Tiny\n")
    to_gguf(d, tmp_path / "a.gguf")
    g = _general(tmp_path / "a.gguf")
    assert g["general.name"] == "Tiny-Demo" and g["general.license"] == "apache-2.0"
    assert g["general.languages"] == ["en", "fr"] and g["general.tags"] == ["x"] and g["general.size_label"].endswith("K")
    assert g["general.architecture"] == "llama" and g["general.type"] == "model"
    # a GGUF's names survive --from-gguf then --to-gguf (kept in the manifest's metrics)
    back = from_gguf(tmp_path / "a.gguf", tmp_path / "back")
    assert not (back / "README.md").exists()
    to_gguf(back, tmp_path / "b.gguf")
    g2 = _general(tmp_path / "b.gguf")
    assert {k: g2[k] for k in g} == {k: v for k, v in g.items() if k != "general.file_type"} | \
        {"general.file_type": g2["general.file_type"]}
    assert json.loads((back / "prunus.json").read_text())["metrics"]["gguf_general"]["general.license"] == "apache-2.0"
