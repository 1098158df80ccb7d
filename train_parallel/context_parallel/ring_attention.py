"""Ring attention: causal attention over a sequence split across the context-parallel ranks.

Each of the ``n`` ranks holds two chunks of every sequence, chunk ``r`` and chunk
``2n-1-r`` of ``2n`` equal chunks (the causal load balance: every rank does the same
work), as queries, keys and values. Key/value blocks travel round the ring
(``dist.batch_isend_irecv``, rank r sends to r+1): the transfer of the next block is
posted before the current one is computed on, so communication overlaps compute.

Blocks are merged by log-sum-exp (online softmax). With the local chunks ``(r, 2n-1-r)``
and a block from rank ``j``:

* ``j == r``: causal attention over the local 2 chunks (their order is increasing);
* ``j < r``: every local query sees chunk ``j`` and none sees chunk ``2n-1-j``;
* ``j > r``: the second local chunk sees both of ``j``'s chunks, the first none.

so every step but the first is exactly half a block of work. Backward (a custom
``autograd.Function``) recomputes attention block by block from the merged output
and log-sum-exp (as flash attention does) and passes dK/dV round the ring with the
blocks they belong to; after ``n`` hops each rank holds its own dK/dV.

Block attention is torch's fused kernel that returns the log-sum-exp: on CPU
``_scaled_dot_product_flash_attention_for_cpu`` and its backward, on CUDA the
memory-efficient kernel (any float dtype), with the layer's attention scale
(``query_pre_attn_scalar``). Layers with a sliding window or soft-capped scores (Mistral,
Gemma 2), which those kernels cannot express, take an explicit block path instead: scores,
cap and mask from the absolute positions of the block's queries and keys, fp32 softmax
statistics merged the same way, and a hand-written backward (for capped scores
s = c tanh(x / c), ds/dx = 1 - tanh^2); a block the window hides entirely is skipped.
Works on gloo and NCCL alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from prunus.artifacts.errors import PrunusError
from prunus.models.llama import CausalAttention, repeat_kv

aten = torch.ops.aten


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale * q k^T) v (scale None: 1/sqrt(d)) and its log-sum-exp (batch, heads, q_len), fp32."""
    if q.is_cuda:
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        return out, lse[..., : q.shape[2]]  # the kernel may pad the log-sum-exp to a multiple of 32
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def block_attention_backward(dout, q, k, v, out, lse, causal: bool,
                             scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block, given the *merged* output and log-sum-exp of the rows of q."""
    if q.is_cuda:
        no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed / offset: unused without dropout
        lse = F.pad(lse, (0, -lse.shape[-1] % 32))  # the kernel's log-sum-exp rows come padded to a multiple of 32
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse.contiguous(), no_rng, no_rng, 0.0, [True, True, True, False], causal,
            scale=scale)
        return dq, dk, dv
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse.contiguous(), 0.0, causal,
                                                                     scale=scale)


def _scores(q, k, scale: float, softcap: float | None):
    """(scores, tanh of the capped scores or None), fp32: scale * q k^T, then softcap * tanh(. / softcap)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is None:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, t


def explicit_block_attention(q, k, v, visible: torch.Tensor, scale: float,
                             softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block with what the fused kernels cannot express (a sliding window's mask, soft-capping): the output
    and log-sum-exp as :func:`block_attention`, fp32; a row that sees no key gives 0 and log-sum-exp -inf."""
    s, _ = _scores(q, k, scale, softcap)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return torch.matmul(p, v.float()), lse


def explicit_block_attention_backward(dout, q, k, v, out, lse, visible: torch.Tensor, scale: float,
                                      softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one :func:`explicit_block_attention` block from the merged output and log-sum-exp."""
    s, t = _scores(q, k, scale, softcap)
    p = torch.exp(s - lse.unsqueeze(-1)).masked_fill(~visible, 0.0)
    dout = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, v.float().transpose(-1, -2))
    ds = p * (dp - (dout * out.float()).sum(dim=-1, keepdim=True))
    if t is not None:
        ds = ds * (1 - t * t)
    return torch.matmul(ds, k.float()) * scale, torch.matmul(ds.transpose(-1, -2), q.float()) * scale, dv


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's softmax into the running one, in place: out (.., s, d) and lse (.., s), fp32."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out.float() * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


class Ring:
    """The context-parallel group as a ring: ``shift`` posts send-to-next and receive-from-previous."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, t: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Post the transfer of ``t`` one hop round the ring; returns (the buffer being filled, its requests)."""
        buf = torch.empty_like(t)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, self.next, self.group),
                                       dist.P2POp(dist.irecv, buf, self.prev, self.group)])
        return buf, reqs

    @staticmethod
    def wait(reqs) -> None:
        for req in reqs:
            req.wait()


def _block(step: int, rank: int, size: int, half: int):
    """(query slice, key/value slice, causal) of this rank's work on the block ``step`` hops away."""
    src = (rank - step) % size
    everything = slice(None)
    if step == 0:
        return everything, everything, True
    if src < rank:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


@dataclass(frozen=True)
class Variant:
    """The layer's attention variants (from the model's ``CausalAttention``): a sliding window, soft-capping,
    the scale (None: 1/sqrt(head_dim)). A window or a soft-cap takes the explicit block path."""

    window: int | None = None
    softcap: float | None = None
    scale: float | None = None

    @property
    def explicit(self) -> bool:
        return self.window is not None or self.softcap is not None


def _positions(rank: int, size: int, half: int, device) -> torch.Tensor:
    """Absolute positions of ``rank``'s two chunks (``rank`` and ``2*size-1-rank``, ``half`` tokens each)."""
    second = 2 * size - 1 - rank
    return torch.cat([torch.arange(rank * half, (rank + 1) * half, device=device),
                      torch.arange(second * half, (second + 1) * half, device=device)])


def _plan(step: int, ring: Ring, half: int, variant: Variant, device):
    """(query slice, key slice, causal, visible): ``visible`` the (q, k) mask of the explicit path, else None."""
    qs, ks, causal = _block(step, ring.rank, ring.size, half)
    if not variant.explicit:
        return qs, ks, causal, None
    qpos = _positions(ring.rank, ring.size, half, device)[qs][:, None]
    kpos = _positions((ring.rank - step) % ring.size, ring.size, half, device)[ks][None, :]
    visible = kpos <= qpos
    if variant.window is not None:
        visible &= kpos > qpos - variant.window
    return qs, ks, causal, visible


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, variant: Variant):
        ring = Ring(group)
        half = q.shape[2] // 2
        scale = variant.scale if variant.scale is not None else q.shape[-1] ** -0.5
        out = torch.zeros_like(q, dtype=torch.float32)  # q's memory layout: the model's reshape for wo is then a view
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # one message per hop
        for step in range(ring.size):
            if step + 1 < ring.size:
                next_kv, reqs = ring.shift(kv)  # in flight while this block is computed
            qs, ks, causal, visible = _plan(step, ring, half, variant, q.device)
            qb, kb, vb = q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks]
            if visible is None:
                merge_block(out[:, :, qs], lse[:, :, qs], *block_attention(qb, kb, vb, causal, variant.scale))
            elif visible.any():  # a window may hide a whole block
                merge_block(out[:, :, qs], lse[:, :, qs],
                            *explicit_block_attention(qb, kb, vb, visible, scale, variant.softcap))
            if step + 1 < ring.size:
                ring.wait(reqs)
                kv = next_kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.variant = group, variant
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, variant = Ring(ctx.group), ctx.variant
        half = q.shape[2] // 2
        scale = variant.scale if variant.scale is not None else q.shape[-1] ** -0.5
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv_in = dkv_reqs = None
        for step in range(ring.size):
            if step + 1 < ring.size:
                next_kv, kv_reqs = ring.shift(kv)
            qs, ks, causal, visible = _plan(step, ring, half, variant, q.device)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            args = (dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], out[:, :, qs], lse[:, :, qs])
            grads = None
            if visible is None:
                grads = block_attention_backward(*args, causal, variant.scale)
            elif visible.any():
                grads = explicit_block_attention_backward(*args, visible, scale, variant.softcap)
            if grads is not None:
                dq[:, :, qs] += grads[0]
                dkv[0][:, :, ks] += grads[1]
                dkv[1][:, :, ks] += grads[2]
            if dkv_reqs is not None:  # what the ranks before added for this block
                ring.wait(dkv_reqs)
                dkv += dkv_in
            dkv_in, dkv_reqs = ring.shift(dkv)  # on with its block; after the last hop: to the block's owner
            if step + 1 < ring.size:
                ring.wait(kv_reqs)
                kv = next_kv
        ring.wait(dkv_reqs)
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                   variant: Variant = Variant()) -> torch.Tensor:
    """Causal attention of the load-balanced local chunks (batch, heads, 2 chunks, head_dim) over the whole sequence."""
    if dist.get_world_size(group) == 1:
        return CausalAttention(variant.window, variant.softcap, variant.scale)(q, k, v)
    if q.shape[2] % 2 or k.shape[2] != q.shape[2]:
        raise PrunusError(f"ring attention: the local sequence ({q.shape[2]} queries, {k.shape[2]} keys) must be two "
                          "equal chunks; shard the batch with prunus.train_parallel.context_parallel.context_parallel.shard_batch")
    return _RingAttention.apply(q, k, v, group, variant)


class RingAttention(nn.Module):
    """Drop-in for the model's ``CausalAttention`` core under ``--cp N --cp-impl ring``; no parameters.
    ``core``: the core it replaces, whose window, soft-cap and scale it keeps."""

    def __init__(self, group, core: nn.Module | None = None):
        super().__init__()
        self.group = group
        self.variant = Variant(*(getattr(core, a, None) for a in ("window", "softcap", "scale")))

    def forward(self, q, k, v, mask=None):
        if mask is not None:
            raise PrunusError("ring attention trains on whole sequences: it takes no KV cache or mask")
        k, v = repeat_kv(k, v, q.shape[1])
        return ring_attention(q, k, v, self.group, self.variant)
