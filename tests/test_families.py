"""Every Hugging Face family prunus converts, against transformers itself (offline, tiny random models):
logits within 1e-5, identical greedy tokens through prunus's KV cache (past the sliding window where there
is one), a bit-exact round trip back to a checkpoint transformers loads, sharded checkpoints, and rope
tables equal to transformers' for every rope type."""

import json

import pytest
import torch

from hf_family_cases import FAMILIES, SLIDING, VOCAB, WINDOW, make_hf_model
from prunus.models import generate, load_model
from prunus.models.hf_convert import from_hf, to_hf
from prunus.models.hf_weights import INDEX, read_weights
from prunus.models.rope import rope_tables

transformers = pytest.importorskip("transformers")

PROMPT, NEW = 5, 16  # 21 tokens in all: more than three sliding windows of WINDOW
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _tokens(seed: int, length: int = 20) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def _hf_dir(tmp_path, family, dtype=torch.float32, **save):
    model = make_hf_model(family, dtype=dtype)
    model.save_pretrained(tmp_path / "hf", **save)
    return model, tmp_path / "hf"


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_match_transformers(tmp_path, family):
    hf, hf_dir = _hf_dir(tmp_path, family)
    ours = load_model(from_hf(hf_dir, tmp_path / "m"))
    n_params = sum(p.numel() for p in hf.parameters())
    assert ours.config.num_params() == sum(p.numel() for p in ours.parameters()) == n_params
    tokens = _tokens(1)
    with torch.no_grad():
        ref, got = hf(tokens).logits, ours(tokens)
    delta = (ref - got).abs().max().item()
    assert delta < 1e-5, f"{family}: max |dlogits| = {delta:.3g}"

    prompt = tokens[:, :PROMPT]
    hf.generation_config.eos_token_id = None  # never stop early: compare every token
    want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                       pad_token_id=0)
    assert torch.equal(generate(ours, prompt, NEW), want)

    if family in SLIDING:  # the window is live: attending to everything gives other logits
        assert PROMPT + NEW > 3 * WINDOW and ours.config.sliding_window == WINDOW
        for block in ours.layers.values():
            block.attention.core.window = None
        with torch.no_grad():
            assert (ours(tokens) - got).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_exact(tmp_path, family, dtype):
    _hf_dir(tmp_path, family, DTYPES[dtype])
    model_dir = from_hf(tmp_path / "hf", tmp_path / "m")
    assert load_model(model_dir).config.dtype == str(DTYPES[dtype]).removeprefix("torch.")
    back = to_hf(model_dir, tmp_path / "back")
    # the same tensors, names and dtypes: the safetensors files are byte for byte the same
    assert (back / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
    c0, c1 = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", back))
    assert (c1["model_type"], c1["architectures"]) == (c0["model_type"], c0["architectures"])
    assert {k: c1.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == \
        {k: c0.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    ref, reloaded = (transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
                     for d in (tmp_path / "hf", back))
    assert next(reloaded.parameters()).dtype == DTYPES[dtype]
    with torch.no_grad():
        assert torch.equal(reloaded(_tokens(2)).logits, ref(_tokens(2)).logits)


def test_fp16_round_trip_is_bit_exact(tmp_path):
    _hf_dir(tmp_path, "qwen2", torch.float16)
    back = to_hf(from_hf(tmp_path / "hf", tmp_path / "m"), tmp_path / "back")
    assert (back / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()


def test_sharded_checkpoints_both_ways(tmp_path):
    hf, hf_dir = _hf_dir(tmp_path, "mixtral", max_shard_size="100KB")
    assert (hf_dir / INDEX).is_file() and len(list(hf_dir.glob("model-*.safetensors"))) > 1
    model_dir = from_hf(hf_dir, tmp_path / "m")
    back = to_hf(model_dir, tmp_path / "back", max_shard_size="100KB")
    index = json.loads((back / INDEX).read_text())
    orig, new = read_weights(hf_dir), read_weights(back)
    shards = {}
    for name, f in index["weight_map"].items():  # each shard holds at most 100 KB of tensors, or one bigger tensor
        shards.setdefault(f, []).append(new[name].numel() * new[name].element_size())
    assert len(shards) > 1 and all(sum(s) <= 100_000 or len(s) == 1 for s in shards.values())
    assert sorted(p.name for p in back.glob("*.safetensors")) == sorted(shards)
    assert orig.keys() == new.keys() and all(torch.equal(orig[k], new[k]) for k in orig)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in new.values())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(_tokens(3)).logits, hf(_tokens(3)).logits)


ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 64,
                              "attention_factor": 0.9},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("rope", ROPES)
def test_rope_tables_equal_transformers(rope):
    from prunus.models.hf_families import config_from_hf

    hf_cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64,
                                      max_position_embeddings=256, rope_parameters={"rope_theta": 50000.0, **ROPES[rope]})
    _, cfg = config_from_hf(hf_cfg.to_dict(), "float32")
    cos, sin = rope_tables(cfg)
    emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_cfg)
    x = torch.zeros(1)
    want_cos, want_sin = emb(x, torch.arange(256)[None])
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    if rope == "dynamic":  # beyond the original context: row p is transformers' rotation of a (p + 1)-token sequence
        long_cos, long_sin = rope_tables(cfg.replace(max_seq_len=400))
        assert torch.equal(long_cos[:256], cos)
        for p in (256, 300, 399):
            want_cos, want_sin = emb(x, torch.arange(p + 1)[None])
            assert torch.allclose(long_cos[p], want_cos[0, p], atol=1e-5)
            assert torch.allclose(long_sin[p], want_sin[0, p], atol=1e-5)


# config.json as transformers 4 wrote it (rope_scaling and rope_theta at the top, old key spellings, keys left
# out), for each family: prunus reads the same model from it as from transformers 5's own reading of it
V4_CONFIGS = {
    "llama": dict(rope_theta=5e5, rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                "original_max_position_embeddings": 128, "rope_type": "llama3"}),
    "qwen2": dict(rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
                  sliding_window=131072, use_sliding_window=False, max_window_layers=21),
    "qwen3": dict(rope_theta=1e6, rope_scaling=None, head_dim=32, sliding_window=None, use_sliding_window=False),
    "mistral": dict(rope_theta=1e4, sliding_window=4096),
    "gemma2": dict(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", head_dim=16,
                   query_pre_attn_scalar=16, sliding_window=4096, cache_implementation="hybrid"),
    "phi3": dict(rope_scaling=None, sliding_window=2047, original_max_position_embeddings=4096,
                 bos_token_id=1, eos_token_id=2, pad_token_id=3),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6, sliding_window=None),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      mlp_only_layers=[], decoder_sparse_step=1, head_dim=16, rope_theta=1e6, rope_scaling=None),
}


@pytest.mark.parametrize("family", V4_CONFIGS)
def test_older_config_json_reads_as_transformers_reads_it(family):
    from prunus.models.hf_families import config_from_hf

    raw = dict(model_type=family, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=1024, **V4_CONFIGS[family])
    _, ours = config_from_hf(dict(raw), "float32")
    _, via_transformers = config_from_hf(transformers.AutoConfig.for_model(**raw).to_dict(), "float32")
    assert ours == via_transformers
