"""Differentiable collectives over one process group, and the byte counter that watches them.

The 2D / 2.5D / 3D layers are written with four operations, each the other's
transpose in the backward pass:

* :func:`all_gather` (concatenate the group's shards along a dim; backward: reduce-scatter of the
  gradient, as every rank used the gathered tensor for a different part of the output);
* :func:`reduce_scatter` (sum the group's partial results and keep this rank's slice; backward:
  all-gather);
* :func:`all_reduce` (sum a value every rank then uses for its own slice: backward all-reduce);
* :func:`copy_to` (a parameter replicated over a group whose ranks see different tokens: identity
  forward, the gradients summed in backward);
* :func:`all_reduce_shared` (a sum every rank then uses identically, the loss: backward identity).

Every call names the layer it serves (``label``); while :func:`count_bytes` is active each rank adds
the bytes it sends under that label, as ring algorithms send them: all-gather ``(g-1) * shard``,
reduce-scatter ``(g-1)/g * input``, all-reduce ``2 (g-1)/g * input`` for a group of ``g`` ranks.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist

_COUNTER: dict | None = None  # label -> bytes sent by this rank, while count_bytes() is active


@contextlib.contextmanager
def count_bytes():
    """Count the bytes this rank sends through these collectives, per layer label (forward and backward)."""
    global _COUNTER
    previous, _COUNTER = _COUNTER, defaultdict(float)
    try:
        yield _COUNTER
    finally:
        _COUNTER = previous


def _record(label: str, nbytes: float) -> None:
    if _COUNTER is not None:
        _COUNTER[label] += nbytes


def _gather(x: torch.Tensor, dim: int, group, label: str) -> torch.Tensor:
    g = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((g * x.shape[0], *x.shape[1:])) if dim == 0 else None
    _record(label, (g - 1) * x.numel() * x.element_size())
    if dim == 0:
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((g * x0.shape[0], *x0.shape[1:]))
    dist.all_gather_into_tensor(out, x0, group=group)
    return out.movedim(0, dim).contiguous()


def _scatter(x: torch.Tensor, dim: int, group, label: str) -> torch.Tensor:
    g = dist.get_world_size(group)
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // g, *x0.shape[1:]))
    _record(label, (g - 1) / g * x0.numel() * x0.element_size())
    dist.reduce_scatter_tensor(out, x0, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce(x: torch.Tensor, group, label: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    g = _size(group)
    x = x.contiguous().clone()
    if g == 1:
        return x
    _record(label, 2 * (g - 1) / g * x.numel() * x.element_size())
    dist.all_reduce(x, op=op, group=group)
    return x


class _GatherOrScatter(torch.autograd.Function):
    """All-gather forward and reduce-scatter backward (``gather``), or the other way round: each the other's
    adjoint."""

    @staticmethod
    def forward(ctx, x, dim, group, label, gather):
        ctx.dim, ctx.group, ctx.label, ctx.gather = dim, group, label, gather
        return (_gather if gather else _scatter)(x, dim, group, label)

    @staticmethod
    def backward(ctx, grad):
        return (_scatter if ctx.gather else _gather)(grad, ctx.dim, ctx.group, ctx.label), None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label, backward_reduces):
        ctx.group, ctx.label, ctx.backward_reduces = group, label, backward_reduces
        return _reduce(x, group, label)

    @staticmethod
    def backward(ctx, grad):
        return (_reduce(grad, ctx.group, ctx.label) if ctx.backward_reduces else grad), None, None, None


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad, ctx.group, ctx.label), None, None


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_gather(x: torch.Tensor, dim: int, group, label: str) -> torch.Tensor:
    return x if _size(group) == 1 else _GatherOrScatter.apply(x, dim, group, label, True)


def reduce_scatter(x: torch.Tensor, dim: int, group, label: str) -> torch.Tensor:
    return x if _size(group) == 1 else _GatherOrScatter.apply(x, dim, group, label, False)


def all_reduce(x: torch.Tensor, group, label: str) -> torch.Tensor:
    return x if _size(group) == 1 else _AllReduce.apply(x, group, label, True)


def all_reduce_shared(x: torch.Tensor, group, label: str) -> torch.Tensor:
    return x if _size(group) == 1 else _AllReduce.apply(x, group, label, False)


def copy_to(x: torch.Tensor, groups, label: str) -> torch.Tensor:
    """``x`` as it is, its gradient summed over each group in ``groups`` (None entries skipped)."""
    for group in groups:
        if _size(group) > 1:
            x = _CopyTo.apply(x, group, label)
    return x


def all_reduce_max(x: torch.Tensor, group, label: str) -> torch.Tensor:
    """The group's elementwise maximum (no gradient: used to stabilise a softmax)."""
    return x if _size(group) == 1 else _reduce(x.detach(), group, label, op=dist.ReduceOp.MAX)
