"""Data parallelism for any ``nn.Module``: DDP (ZeRO-0/1) or FSDP2 (ZeRO-2/3), optionally with BatchNorm
synchronised over the ranks (:mod:`.sync_batchnorm`).

The module is left as the user wrote it: every rank first takes rank 0's parameters and buffers (a module
built anywhere starts identical everywhere), then DDP wraps it, or FSDP2's ``fully_shard`` shards the whole
module as one unit (a generic module has no known blocks; per-block units come with a user's plan).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from .data_parallel import apply_ddp
from .sync_batchnorm import convert_sync_batchnorm


@torch.no_grad()
def broadcast_from_first(module: torch.nn.Module, group) -> None:
    """Every parameter and buffer of ``module`` set to the group's first rank's values."""
    src = dist.get_global_rank(group, 0)
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=src, group=group)


def parallelize_any(module: torch.nn.Module, dims, *, sync_batchnorm: bool = False) -> torch.nn.Module:
    """``module`` (on its device) under the data parallelism ``dims`` (a ParallelDims) asks for; returns what the
    training step calls: the module itself (one process, or sharded in place by FSDP2) or its DDP wrapper."""
    if dims.dp_cp == 1:
        return module
    mesh = dims.data_parallel_mesh
    broadcast_from_first(module, mesh.get_group())
    if sync_batchnorm:
        module = convert_sync_batchnorm(module, mesh.get_group())
    if dims.fsdp_enabled:
        fully_shard(module, mesh=mesh, reshard_after_forward=dims.zero == 3)
        return module
    return apply_ddp(module, mesh)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 shards in place: the module itself)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
