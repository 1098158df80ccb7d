"""How a prunus Llama lays out in a GGUF file: tensor names and llama.cpp's rotary row order.

Shared by :mod:`prunus.models.gguf_read` and :mod:`prunus.models.gguf_write` so the two
directions cannot drift apart.

llama.cpp applies rotary embeddings to adjacent pairs of a head's rows (the layout of
Meta's original checkpoints), prunus and Hugging Face to its two halves ("rotate half").
llama.cpp's converter therefore permutes the rows of every q and k projection
(``LlamaModel.permute`` in its ``convert_hf_to_gguf.py``); :func:`to_gguf_rows` is that
permutation and :func:`from_gguf_rows` its inverse (for the ``llama`` architecture only:
llama.cpp runs Qwen2 / Qwen3 in the rotate-half layout). Both only move rows, so a round
trip is bit-exact.
"""

from __future__ import annotations

import re

import torch

# The GGUF architectures prunus reads and writes. llama.cpp permutes q/k rows for "llama" only; Qwen2 and
# Qwen3 use the rotate-half ("NEOX") rotary layout, so their rows are stored as they are.
ARCHITECTURES = ("llama", "qwen2", "qwen3")
PERMUTED = ("llama",)

TOP = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
       "output.weight": "output.weight"}
LAYER = {
    "attention.wq.weight": "attn_q.weight", "attention.wk.weight": "attn_k.weight",
    "attention.wv.weight": "attn_v.weight", "attention.wo.weight": "attn_output.weight",
    "feed_forward.w1.weight": "ffn_gate.weight", "feed_forward.w2.weight": "ffn_down.weight",
    "feed_forward.w3.weight": "ffn_up.weight",
    "attention_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "attention.wq.bias": "attn_q.bias", "attention.wk.bias": "attn_k.bias", "attention.wv.bias": "attn_v.bias",
    "attention.wo.bias": "attn_output.bias",  # q/k/v biases: Qwen2, Llama's attention_bias (with the output's)
    "attention.q_norm.weight": "attn_q_norm.weight", "attention.k_norm.weight": "attn_k_norm.weight",  # Qwen3
}
_TOP_BACK = {v: k for k, v in TOP.items()}
_LAYER_BACK = {v: k for k, v in LAYER.items()}


def gguf_name(name: str) -> str | None:
    """The GGUF tensor name of a prunus state-dict key (None if it has none)."""
    if name in TOP:
        return TOP[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    return f"blk.{m[1]}.{LAYER[m[2]]}" if m and m[2] in LAYER else None


def prunus_name(name: str) -> str | None:
    """The prunus state-dict key of a GGUF tensor name (None if it has none)."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    return f"layers.{m[1]}.{_LAYER_BACK[m[2]]}" if m and m[2] in _LAYER_BACK else None


def rotary_heads(name: str, n_heads: int, n_kv_heads: int) -> int | None:
    """How many heads the rows of ``name`` (a prunus key) hold if llama.cpp permutes it, else None."""
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return n_heads
    if name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return n_kv_heads
    return None


def to_gguf_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rotate-half rows -> llama.cpp's interleaved pairs, per head (``LlamaModel.permute``)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def from_gguf_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's interleaved pairs -> rotate-half rows: the inverse of :func:`to_gguf_rows`."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
