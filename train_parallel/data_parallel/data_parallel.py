"""Data parallelism: DDP (ZeRO-0), ZeRO-1 (sharded optimizer states), ZeRO-2/3 and HSDP with FSDP2.

| --zero | what is sharded over data-parallel ranks | torch |
|---|---|---|
| 0 | nothing: gradients all-reduced in buckets during backward | DDP |
| 1 | optimizer states | DDP + ZeroRedundancyOptimizer |
| 2 | optimizer states, gradients (parameters kept gathered after forward) | fully_shard(reshard_after_forward=False) |
| 3 | optimizer states, gradients, parameters | fully_shard(reshard_after_forward=True) |

FSDP shards over ``dp_shard`` and replicates over ``dp_replicate`` (HSDP) when the mesh has both.
ZeRO-1's optimizer is built with the others, in ``trainer.build_optimizer``.

Any ``nn.Module`` (the generic kind, :func:`parallelize_any`) is left as the user wrote it: every rank first
takes rank 0's parameters and buffers, then DDP wraps it, or FSDP2 shards the whole module as one unit (a
generic module has no known blocks), its BatchNorm optionally synchronised (:mod:`.sync_batchnorm`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from prunus.artifacts.errors import PrunusError

from .sync_batchnorm import convert_sync_batchnorm


def apply_ddp(model, dp_mesh):
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), bucket_cap_mb=25)


def apply_fsdp(model, dp_mesh, *, zero: int, bf16: bool = False, cpu_offload: bool = False, ignored_params=None) -> None:
    """``ignored_params``: left unsharded (expert parallelism's experts, sharded over ep and reduced by it)."""
    if cpu_offload and not torch.cuda.is_available():
        raise PrunusError("--cpu-offload needs a GPU: torch's CPUOffloadPolicy refuses to run without an accelerator")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    kw = dict(mesh=dp_mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy() if cpu_offload else None,
              ignored_params=set(ignored_params) if ignored_params else None)
    kw = {k: v for k, v in kw.items() if v is not None}
    reshard = zero == 3
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # the last block is gathered again right away for backward: keep it unsharded
        fully_shard(block, reshard_after_forward=reshard and i < len(blocks) - 1, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)


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
