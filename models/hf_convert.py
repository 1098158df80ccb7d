"""Hugging Face Llama interop: ``from_hf`` reads a ``LlamaForCausalLM`` checkpoint dir into a
prunus model dir, ``to_hf`` writes a prunus model dir back out as one.

Only the plain Llama architecture is accepted (no biases, SiLU, unscaled rotary
embeddings, head_dim = hidden_size / num_attention_heads); anything else is
refused with a :class:`PrunusError` rather than converted into a different model.
Both sides use the "rotate half" rotary layout, so weights are only renamed,
never permuted or cast: a round trip is bit-exact. Transformers is not needed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .atomic import atomic_dir, atomic_write_json
from .config import ModelConfig
from .errors import PrunusError
from .llama import Transformer
from .model_dir import load_model, load_model_tokenizer, read_dir_json, save_model, state_dict_for_save
from .tokenizer import TOKENIZER_FILE, ByteTokenizer, HFTokenizer

TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
       "lm_head.weight": "output.weight"}
LAYER = {
    "self_attn.q_proj.weight": "attention.wq.weight", "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight", "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight", "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "input_layernorm.weight": "attention_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
}
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _rename(name: str, top: dict, layer: dict, prefix: str, new_prefix: str) -> str | None:
    if name in top:
        return top[name]
    m = re.fullmatch(re.escape(prefix) + r"(\d+)\.(.+)", name)
    return f"{new_prefix}{m[1]}.{layer[m[2]]}" if m and m[2] in layer else None


def _read_hf_config(hf_dir: Path) -> dict:
    hf = read_dir_json(hf_dir, "config.json",
                       no_dir="no such directory; give a Hugging Face Llama checkpoint dir (config.json + *.safetensors)",
                       no_file="no config.json; give a Hugging Face checkpoint dir written by save_pretrained",
                       bad_json="re-download or re-save the checkpoint")
    archs = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type") != "llama" or "LlamaForCausalLM" not in archs:
        raise PrunusError(f"{hf_dir}: model_type {hf.get('model_type')!r} / architectures {archs} is not a Llama "
                          "(LlamaForCausalLM) checkpoint; only Llama checkpoints can be converted")
    rope, heads = hf.get("rope_parameters") or {}, hf.get("num_attention_heads") or 1
    bad = [f"{k}=true" for k in ("attention_bias", "mlp_bias") if hf.get(k)]
    if hf.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={hf['hidden_act']!r}")
    if hf.get("rope_scaling"):
        bad.append(f"rope_scaling={hf['rope_scaling']!r}")
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        bad.append(f"rope_parameters={rope!r}")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        bad.append("partial_rotary_factor != 1")
    if hf.get("head_dim") not in (None, hf.get("hidden_size", 0) // heads):
        bad.append(f"head_dim={hf['head_dim']} (hidden_size / num_attention_heads = {hf.get('hidden_size', 0) // heads})")
    if bad:
        raise PrunusError(f"{hf_dir}: unsupported Llama feature(s) {', '.join(bad)}; only plain Llama "
                          "(no biases, silu, no rope scaling, head_dim = hidden_size / heads) can be converted")
    return hf


def _read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    if (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif (hf_dir / "model.safetensors.index.json").is_file():
        files = sorted(set(json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"].values()))
    else:
        raise PrunusError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json; "
                          "re-save the checkpoint with save_pretrained(safe_serialization=True)")
    state = {}
    for f in files:
        state.update(load_file(hf_dir / f))
    return state


def from_hf(hf_dir: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Convert a Hugging Face Llama checkpoint dir into a prunus model dir at ``out``."""
    hf_dir = Path(hf_dir)
    hf = _read_hf_config(hf_dir)
    hf_state = _read_hf_weights(hf_dir)
    dtypes = {t.dtype for t in hf_state.values()}
    if len(dtypes) != 1 or not dtypes <= DTYPES.keys():
        raise PrunusError(f"{hf_dir}: weights are stored as {sorted(map(str, dtypes))}; "
                          "only one of float32, bfloat16 or float16 for all tensors is supported")
    try:
        n_heads = hf["num_attention_heads"]
        cfg = ModelConfig(
            dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads, ffn_dim=hf["intermediate_size"],
            vocab_size=hf["vocab_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
            rope_theta=float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=DTYPES[dtypes.pop()],
        )
    except KeyError as e:
        raise PrunusError(f"{hf_dir / 'config.json'}: missing {e.args[0]}; re-save the checkpoint with save_pretrained") from None
    except PrunusError as e:
        raise PrunusError(f"{hf_dir / 'config.json'}: {e}") from None
    state, unknown = {}, []
    for name, tensor in hf_state.items():
        ours = _rename(name, TOP, LAYER, "model.layers.", "layers.")
        if ours is None and not name.endswith("rotary_emb.inv_freq"):  # old checkpoints store the rope table
            unknown.append(name)
        elif ours is not None and not (cfg.tie_embeddings and ours == "output.weight"):
            state[ours] = tensor
    with torch.device("meta"):
        model = Transformer(cfg)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # shape mismatch
        raise PrunusError(f"{hf_dir}: weights do not match config.json ({str(e).splitlines()[-1].strip()})") from None
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "output.weight")]
    if missing or unexpected or unknown:
        raise PrunusError(f"{hf_dir}: weights do not match a Llama with this config.json (missing {missing[:3]}, "
                          f"unrecognised {(unexpected + unknown)[:3]}); give an unmodified LlamaForCausalLM checkpoint")
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.init_buffers(device=torch.device("cpu"))
    tokenizer = HFTokenizer(hf_dir) if (hf_dir / TOKENIZER_FILE).is_file() else ByteTokenizer()
    return save_model(model.eval(), out, tokenizer=tokenizer, stage="convert", overwrite=overwrite,
                      metrics={"hf_source": str(hf_dir.resolve())})


def _bos_id(model_dir: Path) -> int | None:
    """The id of tokenizer_config.json's bos_token in tokenizer.json, if both say so."""
    cfg, tok = model_dir / "tokenizer_config.json", model_dir / TOKENIZER_FILE
    if not (cfg.is_file() and tok.is_file()):
        return None
    bos = json.loads(cfg.read_text()).get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    tok = json.loads(tok.read_text())
    ids = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab = (tok.get("model") or {}).get("vocab")
    return ids.get(bos, vocab.get(bos) if isinstance(vocab, dict) else None)


def to_hf(model_dir: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write the prunus model dir ``model_dir`` as a Hugging Face Llama checkpoint dir at ``out``."""
    model_dir, out = Path(model_dir), Path(out)
    model = load_model(model_dir)  # verifies the manifest's hashes
    tokenizer = load_model_tokenizer(model_dir)
    cfg = model.config
    if cfg.n_experts:
        raise PrunusError(f"{model_dir}: a mixture-of-experts model ({cfg.n_experts} experts) has no Hugging Face "
                          "Llama equivalent; convert a dense model")
    inv_top, inv_layer = {v: k for k, v in TOP.items()}, {v: k for k, v in LAYER.items()}
    state = {_rename(k, inv_top, inv_layer, "layers.", "model.layers."): v for k, v in state_dict_for_save(model).items()}
    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # what transformers 5 reads
        "rope_theta": cfg.rope_theta,  # what transformers 4 reads
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": _bos_id(model_dir), "eos_token_id": tokenizer.eos_id,
    }
    with atomic_dir(out, overwrite=overwrite) as tmp:
        atomic_write_json(tmp / "config.json", hf)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        if isinstance(tokenizer, HFTokenizer):
            tokenizer.save(tmp)
    return out
