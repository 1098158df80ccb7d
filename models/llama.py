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

The Hugging Face families' variants are fields of :class:`ModelConfig` read here, not
other model files: rope scaling (``models/rope.py``), q/k/v and output biases, per-head
q/k norms, sliding windows per layer, attention and final logit soft-capping, the
attention scale, the gate's activation, (1 + w) norms, scaled embeddings and the extra
norms around attention and feed-forward outputs. With the defaults this is plain Llama.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .feed_forward import FeedForward
from .kv_cache import KVCacheProtocol
from .rope import rope_tables


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


def visible_keys(q_len: int, k_len: int, mask: torch.Tensor | None, window: int | None,
                 device=None) -> torch.Tensor | None:
    """The boolean mask of the keys each query attends to, or None where the default layout is exact
    (no mask given, no window that cuts anything: the last query sits at the last key, causal).

    A sliding window keeps the keys fewer than ``window`` positions before the query's own key.
    Without ``mask`` the queries are the last ``q_len`` of ``k_len`` positions; with a cache's mask
    (ragged rows, left padding) a query's own key is the last key its mask shows it (every cache
    lets a token see itself), so windows work under any cache that keeps all keys. While
    ``torch.export`` traces (ONNX graphs with symbolic lengths) the mask is always built: a
    shortcut taken for the example's few keys would be frozen into the graph."""
    if window is None or (k_len <= window and not torch.compiler.is_exporting()):
        return mask
    keys = torch.arange(k_len, device=device)
    if mask is None:
        own = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
        return (keys <= own) & (keys > own - window)
    own = torch.where(mask, keys, -1).amax(dim=-1, keepdim=True)
    return mask & (keys > own - window)


class CausalAttention(nn.Module):
    """softmax(scale * q k^T) v with a causal mask; no parameters.

    q: (batch, heads, q_len, head_dim); k, v: (batch, kv_heads, k_len, head_dim): under
    grouped-query attention each kv head serves heads // kv_heads query heads, and SDPA
    reads them in place (``enable_gqa``) instead of copying the cache. Without ``mask`` the last query
    sits at the last key (a prompt, a decode step, or a chunk after a cached
    prefix); a cache with ragged sequences passes its own boolean ``mask``. Context
    parallelism replaces this module; the projections around it stay as they are.

    The layer's variants are set from the config (:meth:`for_layer`), never by the caller:
    ``window`` (sliding-window attention, see :func:`visible_keys`), ``scale`` (None: SDPA's
    1/sqrt(head_dim)) and ``softcap`` (scores -> softcap * tanh(scores / softcap) before the
    mask, as Gemma 2). SDPA runs everything but soft-capping, which it cannot express: that
    takes the explicit path (scores in the inputs' dtype, softmax in fp32, as transformers).
    """

    def __init__(self, window: int | None = None, softcap: float | None = None, scale: float | None = None):
        super().__init__()
        self.window, self.softcap, self.scale = window, softcap, scale

    @classmethod
    def for_layer(cls, cfg: ModelConfig, layer_id: int) -> "CausalAttention":
        scale = None if cfg.query_pre_attn_scalar is None else cfg.attn_scale
        return cls(window=cfg.layer_window(layer_id), softcap=cfg.attn_softcap, scale=scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q_len, k_len = q.shape[2], k.shape[2]
        gqa = q.shape[1] != k.shape[1]
        mask = visible_keys(q_len, k_len, mask, self.window, q.device)
        if self.softcap is not None:
            return self._softcapped(q, k, v, mask)
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=self.scale)
        if q_len == k_len:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=self.scale)
        if q_len == 1:  # one new token attends to the whole cache
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, scale=self.scale)
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(diagonal=k_len - q_len)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=self.scale)

    def _softcapped(self, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        q_len, k_len = q.shape[2], k.shape[2]
        k, v = repeat_kv(k, v, q.shape[1])
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is None and q_len > 1:
            mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(diagonal=k_len - q_len)
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), computed in fp32 and cast back (Gemma's norm); weight 0 is the identity."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The config's RMSNorm over ``dim`` features: torch's, or the (1 + w) kind."""
    return OffsetRMSNorm(dim, eps=cfg.norm_eps) if cfg.norm_one_plus_weight else nn.RMSNorm(dim, eps=cfg.norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.attn_qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.attn_qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.attn_qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.attn_out_bias)
        # per-head norms of q and k (Qwen3): one head_dim weight shared by every head
        self.q_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.core = CausalAttention.for_layer(cfg, layer_id)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCacheProtocol | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: the boolean (batch, 1, seq, seq) keys each query sees when there is no cache (packed documents)."""
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_id, k, v)
            mask = cache.attn_mask(q.shape[2], k.shape[2])
        out = self.core(q, k, v, mask)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + feed_forward(norm(.)). With ``post_norms`` (Gemma 2)
    each branch's output is normalised again before the residual add."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = make_norm(cfg, cfg.dim)
        self.attention = Attention(cfg, layer_id)
        self.ffn_norm = make_norm(cfg, cfg.dim)
        if cfg.n_experts:
            from .moe import MoE

            self.feed_forward = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim, cfg.hidden_act)
        self.attention_post_norm = make_norm(cfg, cfg.dim) if cfg.post_norms else None
        self.ffn_post_norm = make_norm(cfg, cfg.dim) if cfg.post_norms else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCacheProtocol | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        # the mask goes by keyword: tensor parallelism prepares the attention's positional inputs only
        a = self.attention(self.attention_norm(x), cos, sin, cache, mask=mask) if mask is not None else \
            self.attention(self.attention_norm(x), cos, sin, cache)
        if self.attention_post_norm is not None:
            a = self.attention_post_norm(a)
        h = x + a
        f = self.feed_forward(self.ffn_norm(h))
        if self.ffn_post_norm is not None:
            f = self.ffn_post_norm(f)
        return h + f


class Transformer(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab); with a KV cache, fills it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = make_norm(cfg, cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_buffers(self, device=None) -> None:
        """Recompute the rotary tables, e.g. after building on the meta device."""
        cfg = self.config
        device = device if device is not None else self.rope_cos.device
        self.rope_cos, self.rope_sin = rope_tables(cfg, device=device)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) everywhere, output projections of residual branches scaled by depth; norms are
        the identity (weight 1, or 0 for (1 + w) norms), biases 0."""
        depth_std = std / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1 and (name.endswith(".bias") or self.config.norm_one_plus_weight):
                nn.init.zeros_(p)
            elif p.ndim == 1:
                nn.init.ones_(p)
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "experts.w2", "shared.w2.weight")):
                nn.init.normal_(p, 0.0, depth_std)
            else:
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: torch.Tensor, cache: KVCacheProtocol | None = None,
                positions: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """``cache``: any :class:`prunus.models.kv_cache.KVCacheProtocol`. ``positions`` (seq,) or
        (batch, seq): each token's absolute position, for sequences that are not one contiguous run
        from the cache's ``seq_len`` (context-parallel chunks, ragged batches in serving). Without it,
        positions count on from the cache's ``seq_len`` (from 0 without a cache).

        ``doc_ids`` (batch, seq), without a cache: packed documents. A token attends only to earlier
        tokens with the same id (a block-diagonal causal mask), so no document sees another; give
        ``positions`` restarting at 0 for each document and every document scores as it would alone.

        ``logits_at`` (batch,): the one position of each row whose logits are wanted (a prefill's last
        prompt token); the final norm and the output head run on those positions only, (batch, 1, vocab)."""
        mask = None
        if doc_ids is not None:
            if cache is not None:
                raise ValueError("doc_ids (packed documents) are for training and scoring without a cache")
            n = doc_ids.shape[1]
            causal = torch.ones(n, n, dtype=torch.bool, device=doc_ids.device).tril()
            mask = ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal).unsqueeze(1)
        h = tokens
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.config.scale_embeddings:  # sqrt(dim) rounded to the weights' dtype first, as transformers
                h = h * torch.tensor(self.config.dim ** 0.5).to(h.dtype).item()
        if positions is not None:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
            if cos.ndim == 2:
                cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        else:
            # the tables from the first new position on; attention takes as many rows as it has positions
            # (under sequence parallelism h holds a slice of the sequence, attention the whole of it)
            start = cache.seq_len if cache is not None else 0
            if start is None:
                raise ValueError(f"{type(cache).__name__} holds rows of different lengths: pass positions")
            cos, sin = self.rope_cos[start:], self.rope_sin[start:]
        for layer in self.layers.values():
            h = layer(h, cos, sin, cache) if mask is None else layer(h, cos, sin, cache, mask=mask)
        if cache is not None:
            cache.advance(h.shape[1])
        if logits_at is not None:
            h = h[torch.arange(h.shape[0], device=h.device), logits_at.to(h.device)].unsqueeze(1)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        logits = self.output(h)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
