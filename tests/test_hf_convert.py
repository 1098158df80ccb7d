"""Hugging Face Llama interop: logits and greedy tokens match transformers; round trips are bit-exact."""

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from prunus.models import ByteTokenizer, HFTokenizer, PrunusError, generate, load_model, load_model_tokenizer
from prunus.models.hf_convert import from_hf, to_hf

transformers = pytest.importorskip("transformers")

SHAPES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
              vocab_size=320, max_position_embeddings=128, rope_theta=500000.0, rms_norm_eps=1e-5, initializer_range=0.1)
KEPT = ["architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings", "rope_parameters", "rms_norm_eps",
        "tie_word_embeddings", "dtype", "hidden_act", "attention_bias", "mlp_bias"]


def make_hf(path, *, dtype=torch.float32, tokenizer=False, max_shard_size=None, **overrides):
    """A tiny random LlamaForCausalLM saved at ``path`` (norm weights randomised too, so a swap shows)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**SHAPES, **overrides})
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    model = model.to(dtype).eval()
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tokenizer:  # a word-level tokenizer with <s> = 1 and </s> = 2, as the config's bos/eos say
        from tokenizers import Tokenizer, models, pre_tokenizers

        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate("the quick brown fox".split())}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.add_special_tokens(["<s>", "</s>"])
        tok.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return model


def hf_weights(path):
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(f))
    return state


def test_logits_and_greedy_tokens_match_transformers(tmp_path):
    hf = make_hf(tmp_path / "hf")
    model_dir = from_hf(tmp_path / "hf", tmp_path / "m")
    ours = load_model(model_dir)
    assert isinstance(load_model_tokenizer(model_dir), ByteTokenizer)
    tokens = torch.randint(0, SHAPES["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = hf(tokens).logits, ours(tokens)
    delta = (ref - got).abs().max().item()
    print(f"max |dlogits| = {delta:.3g}")
    assert delta < 1e-5

    prompt = tokens[:, :8]
    hf.generation_config.eos_token_id = None  # never stop early: compare all 8 tokens
    ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = generate(ours, prompt, 8)
    assert torch.equal(got, ref), (got, ref)

    back = to_hf(model_dir, tmp_path / "back")
    config = json.loads((back / "config.json").read_text())
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the checkpoint's own ids, kept
        assert config.get(key) == source.get(key), key
    assert not (back / "tokenizer.json").exists()


@pytest.mark.parametrize("dtype,tie,shard", [(torch.float32, False, None), (torch.float32, True, "60KB"),
                                             (torch.bfloat16, False, None)], ids=["fp32", "tied-sharded", "bf16"])
def test_round_trip_is_bit_exact(tmp_path, dtype, tie, shard):
    make_hf(tmp_path / "hf", dtype=dtype, tokenizer=True, max_shard_size=shard, tie_word_embeddings=tie)
    if shard:
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model_dir = from_hf(tmp_path / "hf", tmp_path / "m")
    ours = load_model(model_dir)
    assert ours.config.dtype == str(dtype).removeprefix("torch.") and ours.config.tie_embeddings == tie
    assert isinstance(load_model_tokenizer(model_dir), HFTokenizer)
    back = to_hf(model_dir, tmp_path / "back")

    orig, new = hf_weights(tmp_path / "hf"), load_file(back / "model.safetensors")
    assert orig.keys() == new.keys() and ("lm_head.weight" in new) == (not tie)
    for k in orig:
        assert orig[k].dtype == new[k].dtype == dtype and torch.equal(orig[k], new[k]), k
    with safe_open(back / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    c0, c1 = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", back))
    assert {k: c0[k] for k in KEPT} == {k: c1[k] for k in KEPT}
    assert (c1["bos_token_id"], c1["eos_token_id"]) == (c0["bos_token_id"], c0["eos_token_id"]) == (1, 2)
    assert (back / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()

    # both dirs loaded the same way (a model cast with .to(bf16) also casts its rotary buffer, so not `hf` itself)
    ref, reloaded = (transformers.LlamaForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
                     for d in (tmp_path / "hf", back))
    assert next(reloaded.parameters()).dtype == dtype
    tokens = torch.randint(0, SHAPES["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, ref(tokens).logits)


def _config_only(path, **changes):
    path.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPES, **changes}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("changes,match", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type 'gpt2'.*not supported; prunus converts llama, qwen2"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0], "long_factor": [1.0]}},
     "rope_type='longrope'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32, "mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"model_type": "gemma2", "hidden_activation": "relu"}, "hidden_activation='relu'"),
    ({"hidden_size": None}, "config.json: model config: dim=None"),
    ({}, "no model.safetensors"),
])
def test_bad_input_is_refused_in_one_line(tmp_path, changes, match):
    bad = _config_only(tmp_path / "bad", **changes)
    with pytest.raises(PrunusError, match=re.escape(str(bad)) + ".*" + match) as err:
        from_hf(bad, tmp_path / "m")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "m").exists()


def test_missing_dir_or_config_is_refused(tmp_path):
    with pytest.raises(PrunusError, match="nope: no such directory"):
        from_hf(tmp_path / "nope", tmp_path / "m")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PrunusError, match="empty: no config.json"):
        from_hf(tmp_path / "empty", tmp_path / "m")


def test_llama_biases_and_explicit_head_dim_match_transformers(tmp_path):
    hf = make_hf(tmp_path / "hf", attention_bias=True, head_dim=32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(from_hf(tmp_path / "hf", tmp_path / "m"))
    assert (ours.config.head_dim, ours.config.attn_qkv_bias, ours.config.attn_out_bias) == (32, True, True)
    tokens = torch.randint(0, SHAPES["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max() < 1e-5


def test_truncated_or_missing_shard_is_named_and_nothing_written(tmp_path):
    make_hf(tmp_path / "hf", max_shard_size="60KB")
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(PrunusError, match=re.escape(str(shard)) + ": tensor .* lie outside the file") as err:
        from_hf(tmp_path / "hf", tmp_path / "m")
    assert "\n" not in str(err.value) and not (tmp_path / "m").exists()
    shard.unlink()
    with pytest.raises(PrunusError, match=f"weight_map.* names '{shard.name}', which is missing from"):
        from_hf(tmp_path / "hf", tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_to_hf_picks_a_family_that_expresses_the_model(tmp_path, tiny_model):
    from prunus.models import save_model

    save_model(tiny_model, tmp_path / "plain", stage="test")  # trained by prunus: no Hugging Face origin
    back = to_hf(tmp_path / "plain", tmp_path / "plain-hf")
    assert json.loads((back / "config.json").read_text())["model_type"] == "llama"
    ref = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ref(tokens).logits - tiny_model(tokens)).abs().max() < 1e-5

    cfg = tiny_model.config.replace(qk_norm=True, sliding_window=8)
    from prunus.models import Transformer

    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights()
    save_model(model.eval(), tmp_path / "qk", stage="test")
    back = to_hf(tmp_path / "qk", tmp_path / "qk-hf")
    assert json.loads((back / "config.json").read_text())["model_type"] == "qwen3"
    with pytest.raises(PrunusError, match="cannot be written as a Hugging Face llama.*qk_norm=True") as err:
        to_hf(tmp_path / "qk", tmp_path / "qk-llama", family="llama")
    assert "\n" not in str(err.value) and not (tmp_path / "qk-llama").exists()
