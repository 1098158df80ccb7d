"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

The one place the architecture is written. It holds no parallelism code: tensor,
sequence and pipeline parallelism are applied to this unmodified module from
``prunus.train_parallel``. Two choices make that possible:

* blocks live in a ``ModuleDict`` keyed by their original index, so deleting a
  block (pipeline stages, pruning) keeps every other parameter name stable;
* ``tok_embeddings``, ``norm`` and ``output`` may be set to ``None`` (a pipeline
  stage that does not own them) and the forward pass skips them; head counts are
  read from the tensors, so column-sharded projections with fewer local heads work.

Rotary embeddings use the "rotate half" layout of Hugging Face's Llama, so its
checkpoints load with no weight permutation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


def rope_tables(head_dim: int, max_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    pos = torch.arange(max_len, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim).

    cos/sin are either (>= seq, head_dim), the table from x's first position on, or
    (batch, seq, head_dim), gathered at each token's own position.
    """
    if cos.ndim == 3:
        cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    else:
        seqlen = x.shape[2]
        cos, sin = cos[:seqlen].to(x.dtype), sin[:seqlen].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def repeat_kv(k: torch.Tensor, v: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query keys and values repeated to ``n_heads`` heads (dim 1), for code that needs one per query head."""
    n_rep = n_heads // k.shape[1]
    if n_rep == 1:
        return k, v
    return k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)


class CausalAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v with a causal mask; no parameters.

    q: (batch, heads, q_len, head_dim); k, v: (batch, kv_heads, k_len, head_dim): under
    grouped-query attention each kv head serves heads // kv_heads query heads, and SDPA
    reads them in place (``enable_gqa``) instead of copying the cache. Without ``mask`` the last query
    sits at the last key (a prompt, a decode step, or a chunk after a cached
    prefix); a cache with ragged sequences passes its own boolean ``mask``. Context
    parallelism replaces this module; the projections around it stay as they are.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q_len, k_len = q.shape[2], k.shape[2]
        gqa = q.shape[1] != k.shape[1]
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        if q_len == k_len:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if q_len == 1:  # one new token attends to the whole cache
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(diagonal=k_len - q_len)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask = None
        if cache is not None:
            k, v = cache.update(self.layer_id, k, v)
            mask = cache.attn_mask(q.shape[2], k.shape[2])
        out = self.core(q, k, v, mask)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg, layer_id)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        if cfg.n_experts:
            from .moe import MoE

            self.feed_forward = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab); with a KV cache, fills it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_buffers(self, device=None) -> None:
        """Recompute the rotary tables, e.g. after building on the meta device."""
        cfg = self.config
        device = device if device is not None else self.rope_cos.device
        self.rope_cos, self.rope_sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) everywhere, output projections of residual branches scaled by depth."""
        depth_std = std / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                nn.init.ones_(p)
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "experts.w2", "shared.w2.weight")):
                nn.init.normal_(p, 0.0, depth_std)
            else:
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: torch.Tensor, cache=None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions`` (seq,) or (batch, seq): each token's absolute position, for sequences
        that are not one contiguous run from the cache's length (context-parallel chunks,
        ragged batches in serving). Without it, positions count on from the cache."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is not None:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
            if cos.ndim == 2:
                cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        else:
            # the tables from the first new position on; attention takes as many rows as it has positions
            # (under sequence parallelism h holds a slice of the sequence, attention the whole of it)
            start = cache.seq_len if cache is not None else 0
            cos, sin = self.rope_cos[start:], self.rope_sin[start:]
        for layer in self.layers.values():
            h = layer(h, cos, sin, cache)
        if cache is not None:
            cache.advance(h.shape[1])
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
