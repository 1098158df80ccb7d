"""Expert parallelism: each of ``ep`` ranks holds ``n_experts / ep`` experts of every MoE layer.

``ep`` borrows its ranks from ``dp_shard`` (as in torchtitan): the ranks of one
ep group see different data, route their own tokens, and exchange them so each
token reaches the rank that holds its expert:

1. the router and grouping run as in one process (``prunus.models.moe.MoE``),
   giving the tokens sorted by expert and a count per expert;
2. the counts go first (``all_to_all_single`` of ``ep x local experts``
   integers), so every rank knows how many rows it sends to and receives from
   each other rank (variable splits);
3. the rows go with ``all_to_all_single`` (autograd: its backward is the
   reverse all-to-all), are regrouped by local expert, computed, put back in
   arrival order and returned by the reverse all-to-all; the layer then
   weights and sums them per token as in one process.

Only ``GroupedExperts`` is replaced, by an ``ExpertParallelExperts`` module
registered under the same name and holding the same parameter names, so the
router and capacity dropping are those of one process: the same tokens are
dropped, since dropping is decided per sequence before dispatch.

Parameters: each expert weight becomes a DTensor ``Shard(0)`` over the ``ep``
mesh (so checkpoints save and reload it under any layout). FSDP leaves these
out (``ignored_params``): they are replicated over the ``dp / ep`` ranks that
hold the same experts, while the dense parameters are sharded over all of dp.
Gradients: a rank's expert gradient is the sum, over its ep group, of the
gradients of each rank's mean loss (the all-to-all backward brings them
home); a hook on each expert parameter all-reduces it over the ranks holding
the same experts (``dp / ep`` of them) and divides by dp, which is the
gradient of the mean loss over all data-parallel ranks, as FSDP gives the
dense parameters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from prunus.models.moe import GroupedExperts, grouped_swiglu, moe_layers


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; backward sends the gradients back the way they came."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


class ExpertParallelExperts(torch.nn.Module):
    """GroupedExperts whose weights are this rank's experts (DTensor shards); tokens travel by all-to-all.

    Built from a ``GroupedExperts`` (:meth:`from_experts`); its parameters keep their names (w1, w2, w3)."""

    def __init__(self, w1: torch.nn.Parameter, w2: torch.nn.Parameter, w3: torch.nn.Parameter, ep_group):
        super().__init__()
        self.w1, self.w2, self.w3 = w1, w2, w3
        self.ep_group = ep_group

    @classmethod
    def from_experts(cls, experts: GroupedExperts, ep_mesh, replica_group, dp: int) -> "ExpertParallelExperts":
        """This rank's share of ``experts``' weights (every rank built the same ones, from the same seed)."""
        ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
        params = []
        for name in ("w1", "w2", "w3"):
            local = getattr(experts, name).detach().chunk(ep, dim=0)[rank].clone()
            p = torch.nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False))
            if not p.is_meta:
                p.register_hook(_grad_hook(replica_group, dp))
            params.append(p)
        return cls(*params, ep_mesh.get_group())

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        group = self.ep_group
        ep = dist.get_world_size(group)
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        local = w1.shape[0]
        send = counts.view(ep, local)  # rows for each (rank, its local expert)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=group)  # recv[src, e]: rows from src for local expert e
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        rows = all_to_all(x, out_splits, in_splits, group)
        # arrival order is (source rank, local expert): regroup by local expert, compute, restore
        expert_of_row = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ep), recv.flatten())
        perm = torch.argsort(expert_of_row, stable=True)
        y = grouped_swiglu(rows[perm], recv.sum(0).tolist(), w1, w2, w3)
        y = torch.empty_like(y).index_copy_(0, perm, y)
        return all_to_all(y, in_splits, out_splits, group)


def _grad_hook(group, dp: int):
    def hook(grad):
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local = local.clone()
        if group is not None:
            dist.all_reduce(local, group=group)
        local = local / dp
        if isinstance(grad, DTensor):
            return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)
        return local
    return hook


def apply_ep(model: torch.nn.Module, ep_mesh, replica_group, dp: int) -> list[torch.nn.Parameter]:
    """Shard every MoE layer's experts over ``ep_mesh`` and route its tokens by all-to-all.

    ``replica_group``: the ranks that hold the same experts (None when ep covers all of dp); ``dp``: data-parallel
    ranks, which the expert gradients are averaged over. Returns the expert parameters (for FSDP to leave out).
    """
    params = []
    for layer in moe_layers(model):
        layer.experts = ExpertParallelExperts.from_experts(layer.experts, ep_mesh, replica_group, dp)
        params += [layer.experts.w1, layer.experts.w2, layer.experts.w3]
    return params
