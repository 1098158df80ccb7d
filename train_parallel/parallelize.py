"""Apply a parallel layout to an unmodified model, in a fixed order:
pipeline split -> tensor/sequence parallel -> LoRA adapters -> context parallel -> expert parallel -> activation checkpointing
-> FSDP / DDP.

Returns what the training step needs: the model parts this rank holds, the
pipeline schedule (or None), whether this rank holds the first / last stage, and
the layout whose decisions were applied (``Parallelized.dims``). Under ``--tp-mode 2d | 2.5d | 3d``
the grid (``tp_nd/``) replaces tensor parallelism and stands alone (activation checkpointing aside);
its vocabulary-parallel loss is ``Parallelized.loss_fn``.

:func:`resolve_layout` is the one check of a layout against the model: training,
the dry run, the local launcher and the Slurm script all call it before anything
starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from prunus.artifacts.errors import PrunusError

from .activation_checkpointing import apply_ac
from .context_parallel.context_parallel import apply_cp, validate_cp
from .data_parallel.data_parallel import apply_ddp, apply_fsdp
from .data_parallel.modes import dp_mode
from .experts.expert_parallel import apply_ep
from .lora import apply_lora
from .parallel_dims import ParallelDims
from .pipeline.pipeline_parallel import build_pipeline, validate_schedule
from .tensor_parallel.tensor_parallel import apply_tp
from .tensor_parallel.tp_nd.apply import apply_tp_nd, grid_mesh, validate_tp_nd


@dataclass
class Parallelized:
    parts: list[torch.nn.Module]
    schedule: object | None  # a torch.distributed.pipelining schedule under --pp
    stage_ids: list[int]  # the pipeline stages the parts are
    n_stages: int
    dims: ParallelDims  # the layout applied, with its decisions (fsdp_enabled, ddp_enabled, ...)
    # the loss of a layout whose logits need their own: (logits, targets, reduction) -> loss (2d/2.5d/3d tp)
    loss_fn: object | None = None

    @property
    def ddp(self) -> bool:
        return self.dims.ddp_enabled

    @property
    def fsdp(self) -> bool:
        return self.dims.fsdp_enabled

    @property
    def loss_parallel(self) -> bool:
        """Logits stay vocabulary-sharded: compute the loss under loss_parallel()."""
        return self.dims.loss_parallel

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)


def local_value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def resolve_layout(cfg, world_size: int, device_type: str | None = None) -> tuple:
    """The validated layout of ``cfg`` (a TrainConfig) on ``world_size`` ranks, checked against its model:
    ``(cfg with the ZeRO stage resolved, ParallelDims)``. Raises PrunusError (one line) for any layout a run
    would refuse; training, the dry run and both launchers call this, before any process starts or waits. Each
    data-parallel mode lays out its own ranks (:mod:`.data_parallel.modes`)."""
    cfg.validate()
    if device_type is None:  # a run (the dry run plans offload on any machine)
        from .data_parallel.offload import check_offload

        check_offload(cfg)
    return dp_mode(cfg).resolve(cfg, world_size, device_type, validate_layout)


def validate_layout(dims: ParallelDims, cfg, model_cfg) -> None:
    """``--dp-mode ddp``'s checks of ``dims`` (the mesh) against ``cfg`` and the model; one line for any it fails."""
    dims.validate_model(model_cfg)
    validate_tp_nd(dims.tp_mode, dims.tp, dims.tp_depth, dims, cfg, model_cfg)
    validate_cp(dims.cp, cfg.cp_impl, cfg.resolved_seq_len(), model_cfg.n_heads, dims.tp, dims.pp,
                moe=bool(getattr(model_cfg, "n_experts", 0)) or dims.ep > 1)
    if dims.ep > 1 and (dims.zero not in (2, 3) or dims.dp_replicate > 1):
        raise PrunusError(f"--ep {dims.ep} composes with FSDP over --dp-shard: use --zero 2 or 3 and --dp-replicate 1")
    if dims.zero in (0, 1) and dims.dp_shard > 1 and dims.dp_replicate > 1:
        raise PrunusError(f"--zero {dims.zero} replicates over all data-parallel ranks; set --dp-replicate or --dp-shard, not both")
    if dims.zero in (0, 1) and (dims.tp > 1 or dims.pp > 1) and dims.dp * dims.cp > 1:
        raise PrunusError(f"--zero {dims.zero} (DDP) composes with data parallelism alone; use --zero 2 or 3 with --tp or --pp")
    if dims.zero in (2, 3) and dims.dp_shard * dims.cp == 1 and dims.dp_replicate > 1:
        raise PrunusError(f"--zero {dims.zero} shards over --dp-shard, which is 1; raise --dp-shard or use --zero 0/1")
    if cfg.batch_size % (dims.dp * cfg.grad_accum):
        raise PrunusError(f"--batch-size {cfg.batch_size} is not divisible by data-parallel ranks x --grad-accum = "
                          f"{dims.dp * cfg.grad_accum}; make it a multiple")
    if dims.pp > 1:
        if cfg.grad_accum != 1:
            raise PrunusError("--grad-accum must be 1 with --pp: the pipeline's --microbatches accumulate instead")
        if model_cfg.tie_embeddings:
            raise PrunusError("tied embeddings cannot be split across pipeline stages; use an untied model with --pp")
        validate_schedule(cfg.pp_schedule, dims.pp, cfg.microbatches, model_cfg.n_layers)
        local = cfg.batch_size // dims.dp
        if local % cfg.microbatches:
            raise PrunusError(f"--microbatches {cfg.microbatches} does not divide the per-rank batch {local}; choose a divisor")


def parallelize(model, dims: ParallelDims, cfg, device: torch.device, *, wrap_ddp: bool = True) -> Parallelized:
    """Apply ``dims``' layout to ``model`` (see the module docstring).

    ``wrap_ddp=False``: leave a DDP layout's model unwrapped (``Parallelized.ddp`` still says DDP); the dry run
    plans on meta tensors, which DDP cannot wrap (it checks shapes with a collective and broadcasts weights),
    and DDP's wrapper changes no parameter."""
    dp_mesh = dims.data_parallel_mesh  # parameters are replicated over data- and context-parallel ranks
    if dims.tp_enabled and dims.tp_mode != "1d":  # 2d / 2.5d / 3d: tensor parallelism alone (validate_tp_nd)
        grid = apply_tp_nd(model, dims.tp_mode, grid_mesh(dims.mesh, dims.tp_mode))
        apply_ac(model, cfg.activation_checkpointing)
        return Parallelized([model], None, [0], 1, dims, loss_fn=grid.loss)

    def parallelize_part(part):
        if dims.tp_enabled:
            apply_tp(part, dims.submesh("tp"), loss_parallel=dims.loss_parallel)
        if getattr(cfg, "lora_rank", 0):  # adapters follow their base weights' TP plan; FSDP shards them with their block
            apply_lora(part, cfg)
        if dims.cp_enabled:
            apply_cp(part, dims.submesh("cp"), cfg.cp_impl)
        experts = []
        if dims.ep_enabled:
            experts = apply_ep(part, dims.submesh("ep"), dims.submesh_group("dp_shard_mod_ep"), dims.dp)
        apply_ac(part, cfg.activation_checkpointing)
        if dims.fsdp_enabled:
            apply_fsdp(part, dp_mesh, zero=dims.zero, bf16=cfg.bf16, cpu_offload=cfg.cpu_offload or cfg.offload, ignored_params=experts)
        return part

    if dims.pp_enabled:
        def loss_fn(logits, targets, scale=None):
            """Per micro-batch: the token mean; with ``scale`` (packed data, targets ignored by IGNORE_INDEX),
            the sum times ``scale`` (the trainer's global-token normalisation)."""
            if scale is None:
                return cross_entropy(logits, targets)
            return cross_entropy(logits, targets, reduction="sum") * scale

        parts, ids, n_stages, schedule = build_pipeline(
            model, dims.submesh("pp"), schedule=cfg.pp_schedule, microbatches=cfg.microbatches, loss_fn=loss_fn,
            device=device, parallelize_part=parallelize_part)
        return Parallelized(parts, schedule, ids, n_stages, dims)
    part = parallelize_part(model)
    if dims.ddp_enabled and wrap_ddp:
        part = apply_ddp(part, dp_mesh)
    return Parallelized([part], None, [0], 1, dims)
