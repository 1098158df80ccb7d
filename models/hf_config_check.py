"""A Hugging Face ``config.json`` checked before anything is built from it: types, bounds, and fit to the weights.

:func:`check_hf_config` gives every key prunus reads its type (a number where a number belongs, true
or false for a flag, an object for ``rope_scaling``, a string ``model_type``, token ids as an id or a
list of ids) and bounds the sizes, so ``"tie_word_embeddings": "no"``, ``"rope_scaling": "yarn"`` or
``num_hidden_layers`` 10**9 is one line naming the key, not a traceback, a silently different model or
an hour spent building layers. :func:`check_fits_weights` then compares the config with the tensors the
safetensors headers declare (layer count, embedding table) before a single tensor is read or a module
built. Null stands for "not set" everywhere, as transformers writes it; keys prunus does not read are
left alone.
"""

from __future__ import annotations

import math
import re

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short

MAX_LAYERS = 1 << 12  # blocks: the deepest published checkpoints have a few hundred
MAX_WIDTH = 1 << 20  # hidden, intermediate and head sizes
MAX_HEADS = 1 << 14
MAX_VOCAB = 1 << 24
MAX_EXPERTS = 1 << 16
MAX_INT = 1 << 40  # any other count (contexts, windows): bounded by the model config's own checks
FIX = "fix config.json or re-save the checkpoint with save_pretrained"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _int(lo: int, hi: int):
    def check(v) -> str | None:
        ok = isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
        return None if ok else f"an integer from {lo} to {hi:,}"
    return check


def _number(v) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return None if ok else "a finite number"


def _bool(v) -> str | None:
    return None if isinstance(v, bool) else "true or false"


def _str(v) -> str | None:
    return None if isinstance(v, str) else "a string"


def _object(v) -> str | None:
    return None if isinstance(v, dict) else "an object"


def _list_of(check, what: str):
    def checked(v) -> str | None:
        ok = isinstance(v, list) and all(check(x) is None for x in v)
        return None if ok else f"a list of {what}"
    return checked


def _token_ids(v) -> str | None:
    one = _int(0, MAX_VOCAB)
    ok = one(v) is None or (isinstance(v, list) and all(one(x) is None for x in v))
    return None if ok else "a token id or a list of token ids"


_POSITIVE = {"hidden_size": MAX_WIDTH, "intermediate_size": MAX_WIDTH, "moe_intermediate_size": MAX_WIDTH,
             "head_dim": MAX_WIDTH, "num_hidden_layers": MAX_LAYERS, "num_attention_heads": MAX_HEADS,
             "num_key_value_heads": MAX_HEADS, "vocab_size": MAX_VOCAB, "num_local_experts": MAX_EXPERTS,
             "num_experts": MAX_EXPERTS, "num_experts_per_tok": MAX_EXPERTS, "max_position_embeddings": MAX_INT,
             "original_max_position_embeddings": MAX_INT}
KEYS = {
    **{k: _int(1, hi) for k, hi in _POSITIVE.items()},
    **dict.fromkeys(("max_window_layers", "sliding_window", "decoder_sparse_step"), _int(0, MAX_INT)),
    **dict.fromkeys(("rms_norm_eps", "rope_theta", "router_aux_loss_coef", "query_pre_attn_scalar",
                     "attn_logit_softcapping", "final_logit_softcapping", "partial_rotary_factor"), _number),
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "norm_topk_prob",
                     "use_bidirectional_attention"), _bool),
    **dict.fromkeys(("hidden_act", "hidden_activation"), _str),
    **dict.fromkeys(("rope_scaling", "rope_parameters"), _object),
    "architectures": _list_of(_str, "strings"), "layer_types": _list_of(_str, "strings"),
    "mlp_only_layers": _list_of(_int(0, MAX_LAYERS), "layer indices"),
    **dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"), _token_ids),
}
ROPE_KEYS = {
    **dict.fromkeys(("rope_type", "type"), _str),
    **dict.fromkeys(("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
                     "mscale", "mscale_all_dim", "rope_theta", "partial_rotary_factor"), _number),
    "original_max_position_embeddings": _int(1, MAX_INT), "truncate": _bool,
}


def _check(data: dict, keys: dict, where: str, prefix: str = "") -> None:
    for key, check in keys.items():
        value = data.get(key)
        if value is not None and (why := check(value)) is not None:
            raise PrunusError(f"{where}: {prefix}{key} is {short(value)}, which must be {why}; {FIX}")


def check_hf_config(hf: dict, where: str) -> None:
    """One PrunusError line "{where}: {key} is ..., which must be ..." for the first key of a Hugging Face
    config.json (``hf``, read from ``where``) whose value has the wrong type or size."""
    if not isinstance(hf.get("model_type"), str):
        raise PrunusError(f"{where}: model_type is {short(hf.get('model_type'))}, which must be a string such as "
                          f"\"llama\"; {FIX}")
    _check(hf, KEYS, where)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(hf.get(key), dict):
            _check(hf[key], ROPE_KEYS, where, prefix=f"{key}.")


def _span(indices: set[int]) -> str:
    return f"{len(indices)} (model.layers.{min(indices)} to {max(indices)})" if indices else "none"


def check_fits_weights(cfg, headers: dict[str, dict], where: str) -> None:
    """The config (a ModelConfig read from ``where``) against the tensors the checkpoint's safetensors headers
    declare (``headers``: tensor name -> header entry): one block per layer index 0..n_layers-1 and an embedding
    table of vocab_size x hidden_size. Checked before any module is built or any tensor read."""
    indices = {int(m[1]) for name in headers if (m := _LAYER.match(name))}
    if indices != set(range(cfg.n_layers)):
        raise PrunusError(f"{where}: num_hidden_layers is {cfg.n_layers:,} but the weights hold layers {_span(indices)}; "
                          "the config does not fit the weights, re-download the checkpoint or fix config.json")
    embed = headers.get("model.embed_tokens.weight")
    if embed is not None and list(embed["shape"]) != [cfg.vocab_size, cfg.dim]:
        raise PrunusError(f"{where}: vocab_size x hidden_size is {cfg.vocab_size} x {cfg.dim} but "
                          f"model.embed_tokens.weight has shape {tuple(embed['shape'])}; the config does not fit the "
                          "weights, re-download the checkpoint or fix config.json")
