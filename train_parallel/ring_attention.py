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
memory-efficient kernel (any float dtype). Works on gloo and NCCL alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from prunus.models.errors import PrunusError
from prunus.models.llama import repeat_kv

aten = torch.ops.aten


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d)) v and its log-sum-exp (batch, heads, q_len), fp32."""
    if q.is_cuda:
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
        return out, lse[..., : q.shape[2]]  # the kernel may pad the log-sum-exp to a multiple of 32
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def block_attention_backward(dout, q, k, v, out, lse, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block, given the *merged* output and log-sum-exp of the rows of q."""
    if q.is_cuda:
        no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed / offset: unused without dropout
        lse = F.pad(lse, (0, -lse.shape[-1] % 32))  # the kernel's log-sum-exp rows come padded to a multiple of 32
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse.contiguous(), no_rng, no_rng, 0.0, [True, True, True, False], causal)
        return dq, dk, dv
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse.contiguous(), 0.0, causal)


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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group):
        ring = Ring(group)
        half = q.shape[2] // 2
        out = torch.zeros_like(q, dtype=torch.float32)  # q's memory layout: the model's reshape for wo is then a view
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # one message per hop
        for step in range(ring.size):
            if step + 1 < ring.size:
                next_kv, reqs = ring.shift(kv)  # in flight while this block is computed
            qs, ks, causal = _block(step, ring.rank, ring.size, half)
            block_out, block_lse = block_attention(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], causal)
            merge_block(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
            if step + 1 < ring.size:
                ring.wait(reqs)
                kv = next_kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = Ring(ctx.group)
        half = q.shape[2] // 2
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv_in = dkv_reqs = None
        for step in range(ring.size):
            if step + 1 < ring.size:
                next_kv, kv_reqs = ring.shift(kv)
            qs, ks, causal = _block(step, ring.rank, ring.size, half)
            dq_b, dk_b, dv_b = block_attention_backward(dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                                        out[:, :, qs], lse[:, :, qs], causal)
            dq[:, :, qs] += dq_b
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            dkv[0][:, :, ks] += dk_b
            dkv[1][:, :, ks] += dv_b
            if dkv_reqs is not None:  # what the ranks before added for this block
                ring.wait(dkv_reqs)
                dkv += dkv_in
            dkv_in, dkv_reqs = ring.shift(dkv)  # on with its block; after the last hop: to the block's owner
            if step + 1 < ring.size:
                ring.wait(kv_reqs)
                kv = next_kv
        ring.wait(dkv_reqs)
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    """Causal attention of the load-balanced local chunks (batch, heads, 2 chunks, head_dim) over the whole sequence."""
    if dist.get_world_size(group) == 1:
        return block_attention(q, k, v, True)[0]
    if q.shape[2] % 2 or k.shape[2] != q.shape[2]:
        raise PrunusError(f"ring attention: the local sequence ({q.shape[2]} queries, {k.shape[2]} keys) must be two "
                          "equal chunks; shard the batch with prunus.train_parallel.context_parallel.shard_batch")
    return _RingAttention.apply(q, k, v, group)


class RingAttention(nn.Module):
    """Drop-in for the model's ``CausalAttention`` core under ``--cp N --cp-impl ring``; no parameters."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, q, k, v, mask=None):
        if mask is not None:
            raise PrunusError("ring attention trains on whole sequences: it takes no KV cache or mask")
        k, v = repeat_kv(k, v, q.shape[1])
        return ring_attention(q, k, v, self.group)
