"""Data parallelism: DDP (ZeRO-0), ZeRO-1 (sharded optimizer states), ZeRO-2/3 and HSDP with FSDP2.

| --zero | what is sharded over data-parallel ranks | torch |
|---|---|---|
| 0 | nothing: gradients all-reduced in buckets during backward | DDP |
| 1 | optimizer states | DDP + ZeroRedundancyOptimizer |
| 2 | optimizer states, gradients (parameters kept gathered after forward) | fully_shard(reshard_after_forward=False) |
| 3 | optimizer states, gradients, parameters | fully_shard(reshard_after_forward=True) |

FSDP shards over ``dp_shard`` and replicates over ``dp_replicate`` (HSDP) when the mesh has both.
ZeRO-1's optimizer is built with the others, in ``trainer.build_optimizer``.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from prunus.artifacts.errors import PrunusError


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
