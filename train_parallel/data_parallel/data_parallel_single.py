"""Single-process data parallelism (``--dp-mode dataparallel``): torch's ``nn.DataParallel``.

One process drives every visible GPU: each forward scatters the batch from device 0 to the others, replicates
the module onto them, runs the replicas in threads, and gathers the outputs back on device 0, where the loss
and the gradient reduction happen. It needs no launcher, but torch's documentation recommends
``DistributedDataParallel`` instead even on one host: DataParallel is one process (the replicas' Python runs
under one GIL), replicates the module on every forward, and funnels inputs, outputs and gradients through
device 0, which also holds the optimizer. It is offered for the quick single-host case and needs more than one
CUDA device (checked before anything starts).
"""

from __future__ import annotations

import torch

from prunus.artifacts.errors import PrunusError

from ..parallel_dims import ParallelDims


def cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def validate_dataparallel(cfg, world_size: int, device_type: str | None = None) -> ParallelDims:
    """The (one-process) layout of ``--dp-mode dataparallel``; one line when this machine or ``cfg`` cannot run it."""
    if world_size != 1:
        raise PrunusError(f"--dp-mode dataparallel runs in one process, not {world_size}; drop --nproc "
                          "(or use --dp-mode ddp for several processes)")
    others = {"--tp": cfg.tp, "--pp": cfg.pp, "--cp": cfg.cp, "--ep": cfg.ep}
    for flag, value in others.items():
        if value != 1:
            raise PrunusError(f"--dp-mode dataparallel does not compose with {flag} {value}; set {flag} 1")
    if cfg.zero not in (None, 0) or cfg.offload or cfg.cpu_offload:
        raise PrunusError("--dp-mode dataparallel replicates the whole model: drop --zero, --offload and --cpu-offload")
    n = cuda_devices()
    if n < 2:
        raise PrunusError(f"--dp-mode dataparallel needs more than one CUDA device; this machine has {n}: "
                          "use --dp-mode ddp")
    return ParallelDims(world_size=1, zero=0, device_type=device_type)


def apply_dataparallel(model: torch.nn.Module) -> torch.nn.Module:
    """The module to call for forward: ``model`` replicated over every visible GPU, outputs on device 0.

    The parameters stay ``model``'s own (on device 0), so the optimizer, clipping and checkpoints see the
    unwrapped model."""
    return torch.nn.DataParallel(model, device_ids=list(range(cuda_devices())), output_device=0)
