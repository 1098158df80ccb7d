"""Bytes autograd keeps for backward on one rank under 2D / 2.5D / 3D tensor parallelism (the dry run's estimate).

With ``R`` the tokens this rank holds in the residual stream (``T / (d q)`` for 2D / 2.5D, ``T / q^2`` for
3D, ``T`` the tp group's micro-batch tokens), ``q`` the grid's side, ``h`` dim, ``w_q`` / ``w_kv`` the
query and key/value widths, ``n`` heads, ``f`` ffn_dim and ``B`` bytes per element, a block keeps::

    R * (4h/q + 2          two norms: input, normalised output, 1/rms
         + 2h + w_q + f    the gathered inputs (one for q/k/v, one for w1/w3, wo's, w2's)
         + (2 w_q + 2 w_kv + n)/q   attention's q, k, v, output and log-sum-exp (this rank's heads)
         + 3f/q) * B       w1's output, its activation, w3's output

Every linear also keeps the weight it gathered (q times its shard), counted with the parameters' working
copies. The head keeps the final norm's ``2h/q + 1``, its gathered input ``h``, the loss's softmax
``V/q`` and its mask (1) per token; the embedding its per-token mask.
"""

from __future__ import annotations

from .shape import grid_side


def grid_rows(mode: str, tp: int, depth: int, tokens: int) -> float:
    q = grid_side(mode, tp, depth)
    return tokens / (q * q) if mode == "3d" else tokens / (depth * q)


def grid_activations(model_cfg, mode: str, tp: int, depth: int, tokens: int, elem_bytes: int = 4) -> dict[str, float]:
    """``{"block", "head", "embedding", "block_input"}``: bytes one block (one micro-batch), the head (norm, output
    and loss), the embedding keep, and a checkpointed block's kept input."""
    q = grid_side(mode, tp, depth)
    R = grid_rows(mode, tp, depth, tokens)
    h, f, n, V = model_cfg.dim, model_cfg.ffn_dim, model_cfg.n_heads, model_cfg.vocab_size
    wq, wkv = n * model_cfg.head_dim, model_cfg.n_kv_heads * model_cfg.head_dim
    block = R * (4 * h / q + 2 + 2 * h + wq + f + (2 * wq + 2 * wkv + n) / q + 3 * f / q)
    head = R * (2 * h / q + 1 + h + V / q + 1)
    lookup_rows = tokens / q if mode == "3d" else R  # 3D looks up chunk r before scattering it over q'
    return {"block": block * elem_bytes, "head": head * elem_bytes, "embedding": lookup_rows * elem_bytes,
            "block_input": R * h / q * elem_bytes}
