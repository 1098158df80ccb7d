"""Bytes each rank sends per layer and training step (forward + backward) under 1D / 2D / 2.5D / 3D tensor parallelism.

Counted as ring collectives send them (:mod:`.collectives`): all-gather ``(g-1) * shard``, reduce-scatter
``(g-1)/g * input``, all-reduce ``2 (g-1)/g * input``, for a group of ``g`` ranks; ``T`` tokens in the
micro-batch of the tensor-parallel group, ``B`` bytes per element. Per linear ``x W^T`` (``K`` in, ``M``
out, ``q`` the grid's side, ``d`` the 2.5D depth):

* 1D (Megatron + SP, ``t`` ranks): the block's inputs gathered over the sequence before attention and
  the MLP and reduce-scattered after them, ``(t-1)/t * T*h`` each, in forward and backward, plus the
  replicated norm weights' gradient all-reduce (the weights never travel);
* 2D / 2.5D: ``x`` all-gathered along the row (once for q/k/v, once for w1/w3) and ``W`` along the column, then their transposes in
  backward: ``2 (q-1) (T K / (d q^2) + M K / q^2)``, with depth ``2 (d-1)/d * M K / q^2`` more for the
  gradient all-reduce over the ``d`` replicas;
* 3D: ``x`` gathered, ``W`` gathered, ``y`` reduce-scattered, each over another face, and back:
  ``2 (q-1) / q^3 * (T K + M K + T M)``.

Norms (all-reduced sums of squares and replicated weights), biases, the embedding (the head's weight
layout, looked up and reduce-scattered) and the vocabulary-parallel loss are written out below. The
counter in :mod:`.collectives` measures the same quantities on real runs; tests/test_tp_nd.py checks that
they agree layer by layer.
"""

from __future__ import annotations

from .shape import grid_side


def _ar(g: int, n: float) -> float:
    return 2 * (g - 1) / g * n if g > 1 else 0.0


class _Grid:
    """Bytes (in elements) of each primitive layer under one mode; the caller multiplies by ``B``."""

    def __init__(self, mode: str, tp: int, depth: int, T: int):
        self.mode, self.tp, self.d, self.T = mode, tp, depth, T
        self.q = grid_side(mode, tp, depth)

    def linear(self, K: int, M: int, bias: bool = False, gathers_input: bool = True) -> float:
        """``gathers_input=False``: the input was gathered for another linear reading it (k, v after q; w3 after w1)."""
        q, d, T = self.q, self.d, self.T
        if self.mode == "3d":
            x = T * K if gathers_input else 0
            return 2 * (q - 1) / q ** 3 * (x + M * K + T * M) + (2 * _ar(q, M / q) if bias else 0)
        x = T * K / (d * q * q) if gathers_input else 0
        out = 2 * (q - 1) * (x + M * K / (q * q)) + _ar(d, M * K / (q * q))
        return out + ((_ar(q, M / q) + _ar(d, M / q)) if bias else 0)

    def norm(self, h: int) -> float:
        q, d, T = self.q, self.d, self.T
        if self.mode == "3d":
            return 2 * _ar(q, T / q ** 2) + 2 * _ar(q, h / q)
        return 2 * _ar(q, T / (d * q)) + _ar(q, h / q) + _ar(d, h / q)

    def embedding(self, V: int, h: int) -> float:
        q, d, T = self.q, self.d, self.T
        if self.mode == "3d":  # table gathered over r and its gradient back; lookup reduce-scattered, gathered back
            return 2 * (q - 1) * V * h / q ** 3 + 2 * (q - 1) / q * T * h / q ** 2
        return 2 * (q - 1) * V * h / q ** 2 + _ar(d, V * h / q ** 2) + 2 * (q - 1) / q * T * h / (d * q)

    def loss(self) -> float:
        q, d, T = self.q, self.d, self.T
        rows = T / q ** 2 if self.mode == "3d" else T / (d * q)
        sums = 2 * _ar(q, 1) if self.mode == "3d" else _ar(q, 1) + _ar(d, 1)  # the token sum: one element
        return 3 * _ar(q, rows) + sums  # max, sum of exponentials, target logit; then the token sum


def _nd_layers(cfg, mode: str, tp: int, depth: int, T: int) -> dict[str, float]:
    g = _Grid(mode, tp, depth, T)
    h, f, V = cfg.dim, cfg.ffn_dim, cfg.vocab_size
    qw, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    bias = cfg.attn_qkv_bias
    block = (g.norm(h) * (2 + 2 * bool(cfg.post_norms)) + g.linear(h, qw, bias) + 2 * g.linear(h, kv, bias, False)
             + g.linear(qw, h, cfg.attn_out_bias) + g.linear(h, f) + g.linear(h, f, gathers_input=False) + g.linear(f, h))
    layers = {"tok_embeddings": g.embedding(V, h)}
    layers.update({f"layers.{i}": block for i in range(cfg.n_layers)})
    layers.update({"norm": g.norm(h), "output": g.linear(h, V), "loss": g.loss()})
    return layers


def _1d_layers(cfg, tp: int, T: int) -> dict[str, float]:
    """Megatron TP + SP with DTensor (tensor_parallel.py): activations move, weights stay."""
    t, h, V = tp, cfg.dim, cfg.vocab_size
    seq = (t - 1) / t * T * h  # one all-gather or reduce-scatter of the block's activations
    block = 8 * seq + 2 * _ar(t, h)  # 2 gathers + 2 scatters, forward and backward; 2 norm weight gradients
    return {"tok_embeddings": 2 * seq, **{f"layers.{i}": block for i in range(cfg.n_layers)},
            "norm": _ar(t, h), "output": 2 * seq, "loss": 3 * _ar(t, T)}


def tp_comm_plan(model_cfg, mode: str, tp: int, depth: int, tokens: int, elem_bytes: int = 4) -> dict[str, int]:
    """``{layer: bytes this rank sends per micro-step, forward + backward}`` for ``tokens`` tokens of the tp group's
    micro-batch (the loss's all-reduces under ``loss``)."""
    if tp == 1:
        return {}
    per = _1d_layers(model_cfg, tp, tokens) if mode == "1d" else _nd_layers(model_cfg, mode, tp, depth, tokens)
    return {name: int(round(v * elem_bytes)) for name, v in per.items()}
