"""The dry run of a generic module (``prunus train --model ... --dry-run``): per-rank memory and the launch command.

The factory builds the module on the meta device (no weight is allocated); what each rank would hold is
counted from the parameters' shapes, in bytes, under the layout the run would use:

* ``params``: DDP / ZeRO-1 (``--zero 0`` / ``1``): every parameter on every rank. ZeRO-2/3 (FSDP2, the whole
  module one ``fully_shard`` unit): each parameter's rows chunked over the ranks as ``torch.chunk`` cuts dim 0
  (rank r holds rows ``[r*c, (r+1)*c)`` of ``c = ceil(rows / dp)``; FSDP's padding is not counted). Pipeline
  (``--pp-split``): the parameters of the rank's stage.
* ``gathered``: ZeRO-2/3 gather the whole unit for forward and backward: the unsharded parameters once more,
  less the rank's own shard.
* ``grads``: one gradient per local element of each trainable parameter, in its dtype.
* ``ddp_buckets``: DDP (ZeRO-0/1) copies gradients into its all-reduce buckets: the gradient bytes once more.
* ``optimizer``: AdamW's ``exp_avg`` and ``exp_avg_sq`` per local element of each parameter it steps plus its
  fp32 ``step`` (4 bytes a parameter); under ZeRO-1 the rank's partition of ``ZeroRedundancyOptimizer``
  (whole tensors, the largest first, each to the rank holding the fewest elements so far, group by group).
* ``buffers``: every buffer, on every rank (BatchNorm's running statistics).

Activations are not counted: they depend on the module's forward, which the dry run does not run.
"""

from __future__ import annotations

import math
import shlex

import torch

from prunus.artifacts.errors import PrunusError

ADAM_STATES, STEP_BYTES = 2, 4


def _nbytes(t: torch.Tensor, numel: int | None = None) -> int:
    return (t.numel() if numel is None else numel) * t.element_size()


def fsdp_shard_numel(t: torch.Tensor, rank: int, world: int) -> int:
    """Elements of ``t`` rank ``rank`` of ``world`` holds when FSDP2 chunks dim 0 (a 0-d tensor: one row)."""
    rows = t.shape[0] if t.ndim else 1
    per = math.ceil(rows / world)
    mine = max(0, min(per, rows - rank * per))
    return mine * (t.numel() // max(rows, 1))


def zero1_partition(groups: list[list[torch.Tensor]], world: int) -> list[list[torch.Tensor]]:
    """The parameters each rank's ZeroRedundancyOptimizer steps (its own partitioning)."""
    sizes, out = [0] * world, [[] for _ in range(world)]
    for params in groups:
        for p in sorted(params, key=lambda t: t.numel(), reverse=True):
            rank = sizes.index(min(sizes))
            out[rank].append(p)
            sizes[rank] += p.numel()
    return out


def _adam(params, numel=lambda p: p.numel()) -> int:
    return sum(ADAM_STATES * _nbytes(p, numel(p)) + STEP_BYTES for p in params)


def _groups(module: torch.nn.Module) -> list[list[torch.Tensor]]:
    """The trainer's optimizer groups: decayed (2+ dims), then the rest (see trainer.build_optimizer)."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    return [g for g in ([p for p in trainable if p.ndim >= 2], [p for p in trainable if p.ndim < 2]) if g]


def _row(rank: int, params: int, gathered: int, grads: int, buckets: int, optimizer: int, buffers: int) -> dict:
    return {"rank": rank, "params": params, "gathered": gathered, "grads": grads, "ddp_buckets": buckets,
            "optimizer": optimizer, "buffers": buffers,
            "total_peak": params + gathered + grads + buckets + optimizer + buffers}


def _data_parallel_rows(module: torch.nn.Module, world: int, zero: int) -> list[dict]:
    params = list(module.parameters())
    groups = _groups(module)
    trainable = [p for g in groups for p in g]
    full, grads = sum(map(_nbytes, params)), sum(map(_nbytes, trainable))
    buffers = sum(map(_nbytes, module.buffers()))
    if world == 1 or zero in (0, 1):
        stepped = zero1_partition(groups, world) if zero == 1 and world > 1 else [trainable] * world
        return [_row(r, full, 0, grads, grads if world > 1 else 0, _adam(stepped[r]), buffers) for r in range(world)]
    rows = []
    for r in range(world):
        local = lambda p, r=r: fsdp_shard_numel(p, r, world)  # noqa: E731
        mine = sum(_nbytes(p, local(p)) for p in params)
        rows.append(_row(r, mine, full - mine, sum(_nbytes(p, local(p)) for p in trainable), 0,
                         _adam(trainable, local), buffers))
    return rows


def _pipeline_rows(module: torch.nn.Module, split: str) -> list[dict]:
    from prunus.train_parallel.pipeline.module_split import parse_split, split_stages

    rows = []
    for r, stage in enumerate(split_stages(module, parse_split(split))):
        trainable = [p for g in _groups(stage) for p in g]
        grads = sum(map(_nbytes, trainable))
        rows.append(_row(r, sum(map(_nbytes, stage.parameters())), 0, grads, 0, _adam(trainable),
                         sum(map(_nbytes, stage.buffers()))))
    return rows


def launch_command(cfg, argv: list[str]) -> str:
    """The command the run would start: ``prunus train ...`` itself, or torchrun's agent over ``cfg.nproc`` ranks."""
    args = " ".join(shlex.quote(a) for a in argv)
    if cfg.nproc == 1:
        return f"prunus train {args}"
    return f"torchrun --standalone --nproc-per-node={cfg.nproc} -m prunus.cli.main train {args}"


def module_memory_plan(cfg, argv: list[str] | None = None) -> dict:
    """{layout, world_size, zero, params_total, ranks: [per-rank bytes], command} of the generic module run ``cfg``
    (a validated ModuleTrainConfig) would start; nothing allocated, no process started."""
    from prunus.models.module_factory import build_module

    if cfg.tp > 1:
        raise PrunusError("--dry-run with --tp: a generic module's tensor parallel layout is not planned yet; plan "
                          "without --tp (the data parallel and pipeline layouts are)")
    with torch.device("meta"):
        module = build_module(cfg.model, cfg.model_args)
    world = cfg.nproc
    if cfg.pp > 1:
        layout, zero, rows = f"pipeline, {cfg.pp} stages ({cfg.pp_schedule})", None, _pipeline_rows(module, cfg.pp_split)
    else:
        zero = cfg.zero_stage()
        layout = ("one process" if world == 1 else
                  {0: "DDP", 1: "DDP + ZeRO-1", 2: "FSDP2 (ZeRO-2)", 3: "FSDP2 (ZeRO-3)"}[zero])
        rows = _data_parallel_rows(module, world, zero)
    return {"layout": layout, "world_size": world, "zero": zero,
            "params_total": sum(p.numel() for p in module.parameters()),
            "param_bytes_total": sum(map(_nbytes, module.parameters())), "ranks": rows,
            "command": launch_command(cfg, argv or [])}
