"""The dry run: per-rank memory of a parallel layout, planned without devices, processes or real tensors.

:func:`memory_plan` builds the model on the meta device, joins torch's *fake*
process group as one rank of ``world_size`` (collectives do nothing; no other
process exists), applies the very ``parallelize`` a training run applies
(pipeline split -> TP/SP -> activation checkpointing -> FSDP / DDP) and the
very optimizer construction (``build_optimizer``, ZeRO-1 included), then reads
the shapes of what this rank would hold. Nothing is allocated: any world size
(1,024 ranks of llama-8b) takes well under a second.

What is counted, in bytes on the planned rank (default rank 0; under --pp the
rank decides the stage):

* ``params`` (persistent): the local shards of this rank's parameters
  (``DTensor.to_local()`` under TP / FSDP), summed over its pipeline parts, in
  the dtype they are stored in (fp32: the trainer builds fp32 weights, also
  under --bf16). FSDP's padding of the last shard is not counted; rank 0 always
  holds a full-size shard.
* ``params_peak``: ``params`` plus the working copies the layout gathers or
  casts, each in the compute dtype (bf16 under --bf16, else fp32):

  - ZeRO-2 (``reshard_after_forward=False``): after forward every FSDP unit
    stays gathered until its backward, so the whole tp-local model is held
    unsharded once more;
  - ZeRO-3: units are gathered one at a time; counted as the root unit
    (embedding, final norm, head) plus the two largest blocks (the one
    computing and the one prefetched / the last block, never resharded);
  - no FSDP with --bf16: autocast's cache of bf16 copies of the Linear weights.
* ``grads``: one gradient per local parameter element in the parameter's dtype
  (fp32; FSDP reduce-scatters into fp32 shards, its reduce dtype).
* ``ddp_buckets``: DDP (ZeRO-0/1) copies gradients into its all-reduce buckets
  (``gradient_as_bucket_view=False``): the gradient bytes once more.
* ``optimizer``: AdamW's ``exp_avg`` and ``exp_avg_sq`` (parameter dtype, fp32)
  for each parameter this rank's optimizer steps, plus its fp32 ``step``
  scalar. Under ZeRO-1 that is this rank's partition of
  ``ZeroRedundancyOptimizer`` (about 1/dp of the parameters, whole tensors).
* ``buffers``: the rotary tables (one copy per pipeline part).
* ``activations``: an estimate, below.

Mixture of experts: under ``--ep`` each rank holds ``n_experts / ep`` experts
of every MoE layer (DTensor shards over ``ep``, left out of FSDP: ``params``,
``grads`` and ``optimizer`` count exactly that share, replicated over the
``dp / ep`` ranks holding the same experts); they are never gathered, so
``params_peak`` adds their local share once as a working copy (an upper bound:
in fp32 none is made). A MoE block's activations replace the ``4f`` of the
SwiGLU by ``4 * moe_ffn_dim * (top_k + n_shared_experts)`` and add the
``2 * top_k * h`` gathered expert inputs and outputs, plus the fp32 router
logits and probabilities (``2 * n_experts``), assuming balanced routing.

``model_state`` = params + grads + optimizer (what a step leaves behind, before
``zero_grad``); ``total_peak`` adds ``params_peak - params``, DDP buckets,
buffers and activations: an upper bound, as activations are freed while
gradients appear. Under --cpu-offload (or --offload) with FSDP the model state
lives in host memory: it is reported as ``host`` and left out of ``total_peak``,
the device's. Under --offload with --zero 0/1 (ZeRO-Offload) the optimizer
states leave the device; ``host`` holds them plus the fp32 master weights and
the host copy of the gradients of the parameters this rank steps.

2D / 2.5D / 3D tensor parallelism (``--tp-mode``, ``tp_nd/``): ``params_peak`` adds the weights each
linear gathers over one side of the grid (``q`` times its shard, kept for backward); activations are
the grid layers' own (``tp_nd/activation_plan.py``); ``tp_comm`` gives the bytes each rank sends per
layer and micro-step (``tp_nd/comm_plan.py``, for 1D too). tests/test_tp_nd.py checks both against
runs: the bytes counted in the collectives and what autograd keeps.

The mesh is built on the CPU whatever the machine (the fake process group
needs no device, and the plan touches none); --cpu-offload is planned, not
applied, so it can be planned on a machine without a GPU. The table the CLI
prints is drawn by :mod:`.dry_run_table`.

Activations (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022, derived again for this model: SwiGLU, grouped-query
attention read in place by SDPA (``enable_gqa``), fused SDPA, no dropout). With
``s`` the sequence length, ``b`` the micro-batch (sequences), ``h`` dim, ``g``
the width of the keys (and of the values), ``n_kv_heads * head_dim``, ``f``
ffn_dim, ``n`` n_heads, ``t`` tp, ``B`` bytes per activation element (2 under
--bf16, else 4), autograd keeps for backward, per block and micro-batch::

    block  = s*b*(2*h + (6*h + 2*g + 4*f)/t) * B  +  s*b*(2 + n/t) * 4

``2h``: the inputs of the q/k/v and w1/w3 projections, gathered over the
sequence (torch's sequence parallelism saves the gathered tensor, where
Megatron saves the shard); ``(6h + 2g)/t``: each RMSNorm's input and normalised
output (sequence-sharded under SP), q, k and v (at the kv heads' width), the
attention output (its reshape for wo is a view); ``4f/t``: w1's output, silu's, w3's and
their product; fp32: the norms' rstd and attention's logsumexp. Fused
attention (flash / memory-efficient) keeps no ``s^2`` scores, so Megatron's
``5*a*s^2*b`` term is absent. For comparison, Megatron's GPT block (GeLU MLP
of 4h, dropout, no SP) is ``s*b*h*(34 + 5*a*s/h)`` bytes with B=2. In fp32 on
one process this matches what autograd saves exactly (tests/test_dry_run.py);
under --bf16 autocast keeps the residual stream in fp32, so it is a little low.

* activation checkpointing: a wrapped block keeps only its input,
  ``s*b*h/t * B`` (``full`` wraps every block, ``every-other`` every other one:
  counted from the wrapped modules), and one block's full activations are
  added for the recomputation in backward;
* the rank holding the head adds ``s*b*(2*h/t + h)*B + s*b*4`` (the final
  norm's input, output and rstd, the head's gathered input) and
  ``s*b*V/t'*(B + 4)`` (the logits and the fp32 log-softmax cross-entropy
  saves; ``t' = t`` under loss parallelism, 1 when the logits are gathered
  under --pp);
* micro-batches in flight: 1 without --pp; GPipe and LoopedBFS run every
  micro-batch forward first (``microbatches``); 1F1B holds
  ``min(microbatches, pp - pp_rank)``; the other schedules (interleaved,
  zero-bubble, V-shaped) are counted as ``min(microbatches, pp)``. The head's
  activations are counted for one micro-batch, except under GPipe / LoopedBFS.
* context parallelism (``--cp``): every term above is per token and each rank
  holds ``s/cp`` tokens of every sequence, so ``s`` is ``s/cp`` throughout (ring
  attention saves what fused SDPA saves, for the local queries; both ring and
  Ulysses repeat the keys and values to every head first, so ``g`` is ``h``), plus the rotary
  tables gathered at the rank's positions, ``2 * s/cp * head_dim * 4`` per
  micro-batch. Ulysses' SDPA saves head-sharded whole sequences (the same bytes as
  q, k, v) and its own output, which is no longer the tensor wo keeps: one more
  ``s/cp*b*h/t * B`` per block.

A generic module (:func:`module_memory_plan`, every rank): the factory builds it on the meta device (no weight is allocated); what each rank would hold is
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

import contextlib
import dataclasses
import math
import shlex

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from prunus.artifacts.errors import PrunusError

from ..config import TrainConfig
from ..data_parallel.modes import dp_mode
from ..parallel_dims import ParallelDims
from ..parallelize import Parallelized, parallelize, resolve_layout
from ..tensor_parallel.tp_nd.activation_plan import grid_activations
from ..tensor_parallel.tp_nd.comm_plan import tp_comm_plan
from ..tensor_parallel.tp_nd.shape import grid_side

ADAM_STATES, STEP_BYTES = 2, 4  # a generic module's plan: AdamW's states a parameter, its fp32 step
FORWARD_FIRST = ("GPipe", "LoopedBFS")  # schedules that run every micro-batch forward before any backward


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _nbytes(t: torch.Tensor, numel: int | None = None) -> int:
    return (t.numel() if numel is None else numel) * t.element_size()


def _tp_local_numel(p: torch.Tensor) -> int:
    """Elements of ``p`` on this rank once gathered over data parallelism (still sharded over tp)."""
    if not isinstance(p, DTensor):
        return p.numel()
    mesh, names = p.device_mesh, p.device_mesh.mesh_dim_names or ()
    factor = 1
    for i, (name, placement) in enumerate(zip(names, p.placements)):
        if name in ("tp", "ep") and not placement.is_replicate() and not placement.is_partial():
            factor *= mesh.size(i)
    return -(-p.numel() // factor)


def _optimizer_params(opt) -> list[torch.Tensor]:
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer steps its partition with an inner optimizer
    return [p for group in inner.param_groups for p in group["params"]]


def _in_flight(cfg: TrainConfig, dims: ParallelDims, pp_rank: int) -> tuple[int, int]:
    """(micro-batches whose block activations are held at once, those whose head activations are)."""
    if dims.pp == 1:
        return 1, 1
    if cfg.pp_schedule in FORWARD_FIRST:
        return cfg.microbatches, cfg.microbatches
    if cfg.pp_schedule == "1F1B":
        return min(cfg.microbatches, dims.pp - pp_rank), 1
    return min(cfg.microbatches, dims.pp), 1


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """Join torch's *fake* process group as ``rank`` of ``world_size`` for the duration (collectives do nothing).

    Why no public alternative: planning a layout needs a DeviceMesh of the real size, and a mesh needs a process
    group; the fake backend is the one that needs no other process. Since torch 2.13 (the version prunus is
    tested with) ``init_process_group("fake")`` registers that backend and makes its store itself, so nothing
    from ``torch.testing`` is imported here."""
    if dist.is_initialized():
        raise PrunusError("dry run: a process group is already initialised in this process; "
                          "run the dry run outside a distributed job")
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def memory_plan(cfg: TrainConfig, world_size: int, rank: int = 0) -> dict:
    """Per-rank memory of ``cfg``'s layout on ``world_size`` ranks, as seen by ``rank``; see the module docstring.

    Raises PrunusError (one line) for a layout a run would refuse, a rank outside the world, or when a process
    group is already initialised in this process (the dry run needs its own, fake one).
    """
    cfg.validate()
    if not dp_mode(cfg).plans_memory:
        raise PrunusError(f"dry run: plans --dp-mode ddp layouts; --dp-mode {cfg.dp_mode} keeps a whole model (and, under "
                          "ps, the optimizer on the servers): plan it as --dp-mode ddp --zero 0")
    if not 0 <= rank < world_size:
        raise PrunusError(f"dry run: rank {rank} is outside the world of {world_size} ranks; choose 0..{world_size - 1}")
    cfg, dims = resolve_layout(cfg, world_size, device_type="cpu")  # the mesh on the CPU, whatever the machine

    from prunus.models import Transformer

    from ..trainer import build_optimizer

    with fake_process_group(rank, world_size):
        dims.mesh  # noqa: B018 (cached: every later use of the mesh gets this one)
        with torch.device("meta"):
            model = Transformer(cfg.model_config())
        model.train()
        # parallelize places nothing (meta stays meta); pipeline stages want a concrete device. DDP cannot wrap
        # meta tensors: the part stays unwrapped (par.ddp still says DDP) and its buckets are counted below.
        planned = dataclasses.replace(cfg, cpu_offload=False, offload=False)  # offload is counted, not applied
        par = parallelize(model, dims, planned, torch.device("cpu"), wrap_ddp=False)
        optimizers = [build_optimizer(part, planned, dims.zero1_mesh) for part in par.parts]
        return _plan(cfg, par, optimizers, rank, dims.submesh_rank("pp"))


def _working_copies(cfg: TrainConfig, par: Parallelized, compute_bytes: int) -> int:
    """Bytes of the parameters' working copies above the persistent ones (gathered by FSDP, cast by autocast, or
    by a 2d / 2.5d / 3d grid: every weight gathered over one side of the grid, q times its shard, is kept for
    the backward pass)."""
    dims = par.dims
    if dims.tp > 1 and dims.tp_mode != "1d":
        q = grid_side(dims.tp_mode, dims.tp, dims.tp_depth)
        matrices = sum(_local(p).numel() for part in par.parts for p in part.parameters() if p.ndim >= 2)
        return q * compute_bytes * matrices
    if par.fsdp and par.dims.zero == 2:
        return sum(_tp_local_numel(p) for part in par.parts for p in part.parameters()) * compute_bytes
    if par.fsdp:
        extra = 0
        for part in par.parts:
            blocks = [sum(_tp_local_numel(p) for p in block.parameters()) for block in part.layers.values()]
            in_blocks = {id(p) for block in part.layers.values() for p in block.parameters()}
            root = sum(_tp_local_numel(p) for p in part.parameters() if id(p) not in in_blocks)
            extra = max(extra, (root + sum(sorted(blocks)[-2:])) * compute_bytes)
        return extra
    if cfg.bf16:
        return 2 * sum(_local(m.weight).numel() for part in par.parts for m in part.modules()
                       if isinstance(m, torch.nn.Linear))
    return 0


def _micro_batch(cfg: TrainConfig, dims: ParallelDims) -> int:
    per_rank_batch = cfg.batch_size // dims.dp
    return per_rank_batch // cfg.microbatches if dims.pp > 1 else per_rank_batch // cfg.grad_accum


def _block_activations(cfg: TrainConfig, dims: ParallelDims, compute_bytes: int) -> float:
    """Bytes one block's backward keeps for one micro-batch (module docstring)."""
    model_cfg = cfg.model_config()
    # s: the tokens of each sequence on this rank (all of them but under context parallelism)
    s, h, f, n, t = cfg.resolved_seq_len() // dims.cp, model_cfg.dim, model_cfg.ffn_dim, model_cfg.n_heads, dims.tp
    b = _micro_batch(cfg, dims)
    # keys and values: at the kv heads' width; context parallelism repeats them to every head before attention
    g = h if dims.cp > 1 else model_cfg.n_kv_heads * model_cfg.head_dim
    block = s * b * (2 * h + (6 * h + 2 * g + 4 * f) / t) * compute_bytes + s * b * (2 + n / t) * 4
    if model_cfg.n_experts:  # mixture of experts: the routed and shared experts' hidden, gathered inputs, router
        k, f_moe, e = model_cfg.top_k, model_cfg.moe_ffn_dim, model_cfg.n_experts
        block += s * b * (4 * f_moe * (k + model_cfg.n_shared_experts) - 4 * f + 2 * k * h) * compute_bytes
        block += s * b * 2 * e * 4
    if dims.cp > 1 and cfg.cp_impl == "ulysses":  # SDPA's head-sharded output is kept apart from wo's input
        block += s * b * h / t * compute_bytes
    return block


def _activations(cfg: TrainConfig, par: Parallelized, pp_rank: int, compute_bytes: int) -> dict:
    """Activation bytes of this rank (an estimate, module docstring), with the counts the plan reports."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    dims, model_cfg = par.dims, cfg.model_config()
    s, h, t, V = cfg.resolved_seq_len() // dims.cp, model_cfg.dim, dims.tp, model_cfg.vocab_size
    b = _micro_batch(cfg, dims)
    if dims.tp > 1 and dims.tp_mode != "1d":  # 2d / 2.5d / 3d keep what their grid layers save
        return _grid_activations(model_cfg, par, s, b, compute_bytes)
    block_full = _block_activations(cfg, dims, compute_bytes)
    blocks = [blk for part in par.parts for blk in part.layers.values()]
    n_ckpt = sum(isinstance(blk, CheckpointWrapper) for blk in blocks)
    per_micro = n_ckpt * s * b * h / t * compute_bytes + (len(blocks) - n_ckpt) * block_full  # wrapped: the input
    blocks_in_flight, heads_in_flight = _in_flight(cfg, dims, pp_rank)
    activations = per_micro * blocks_in_flight + (block_full if n_ckpt else 0)
    if dims.cp > 1:  # the rotary tables gathered at this rank's positions
        activations += 2 * s * model_cfg.head_dim * 4
    if par.has_last:
        t_head = t if dims.loss_parallel else 1  # loss parallelism keeps logits vocabulary-sharded
        head = s * b * (2 * h / t + h) * compute_bytes + s * b * 4 + s * b * V / t_head * (compute_bytes + 4)
        activations += head * heads_in_flight
    return {"activations": int(activations), "blocks": len(blocks), "checkpointed_blocks": n_ckpt,
            "local_seq_len": s, "micro_batch": b, "in_flight": blocks_in_flight}


def _grid_activations(model_cfg, par: Parallelized, s: int, b: int, compute_bytes: int) -> dict:
    """Activation bytes of a rank of a 2d / 2.5d / 3d grid (tp_nd/activation_plan.py, exact against autograd in
    tests/test_tp_nd.py); checkpointed blocks keep their input, and one block is recomputed at a time."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    dims = par.dims
    a = grid_activations(model_cfg, dims.tp_mode, dims.tp, dims.tp_depth, s * b, compute_bytes)
    blocks = [blk for part in par.parts for blk in part.layers.values()]
    n_ckpt = sum(isinstance(blk, CheckpointWrapper) for blk in blocks)
    total = n_ckpt * a["block_input"] + (len(blocks) - n_ckpt) * a["block"] + (a["block"] if n_ckpt else 0)
    total += a["head"] + a["embedding"]
    return {"activations": int(total), "blocks": len(blocks), "checkpointed_blocks": n_ckpt, "local_seq_len": s,
            "micro_batch": b, "in_flight": 1}


def _layout(cfg: TrainConfig, par: Parallelized) -> dict:
    dims = par.dims
    return {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "cp_impl": cfg.cp_impl,
            "tp": dims.tp, "tp_mode": dims.tp_mode, "tp_depth": dims.tp_depth, "pp": dims.pp, "ep": dims.ep,
            "zero": dims.zero, "fsdp": par.fsdp, "ddp": par.ddp,
            "pp_schedule": cfg.pp_schedule if dims.pp > 1 else None,
            "microbatches": cfg.microbatches if dims.pp > 1 else None,
            "activation_checkpointing": cfg.activation_checkpointing, "bf16": cfg.bf16,
            "cpu_offload": par.fsdp and (cfg.cpu_offload or cfg.offload), "offload": cfg.offload}


def _plan(cfg: TrainConfig, par: Parallelized, optimizers, rank: int, pp_rank: int) -> dict:
    compute_bytes = 2 if cfg.bf16 else 4
    params = sum(_nbytes(_local(p)) for part in par.parts for p in part.parameters())
    buffers = sum(_nbytes(b) for part in par.parts for b in part.buffers())
    stepped = [p for opt in optimizers for p in _optimizer_params(opt)]
    optimizer = sum(2 * _nbytes(_local(p)) + 4 for p in stepped)  # exp_avg, exp_avg_sq, fp32 step
    extra = _working_copies(cfg, par, compute_bytes)
    act = _activations(cfg, par, pp_rank, compute_bytes)
    grads = params
    ddp_buckets = grads if par.ddp else 0
    model_state = params + grads + optimizer
    host = device_off = 0
    if par.fsdp and (cfg.cpu_offload or cfg.offload):  # FSDP's CPUOffloadPolicy keeps the shards on the host
        host = device_off = model_state
    elif cfg.offload:  # ZeRO-Offload: AdamW's states, fp32 masters and a gradient copy on the host (offload.py)
        stepped_bytes = sum(_nbytes(_local(p)) for p in stepped)
        host, device_off = optimizer + 2 * stepped_bytes, optimizer
    return {
        "world_size": par.dims.world_size,
        "rank": rank,
        "layout": _layout(cfg, par),
        "model_params": cfg.model_config().num_params(),
        "local_params": sum(_local(p).numel() for part in par.parts for p in part.parameters()),
        "stage_ids": list(par.stage_ids),
        "blocks": act["blocks"],
        "checkpointed_blocks": act["checkpointed_blocks"],
        "seq_len": act["local_seq_len"] * par.dims.cp,
        "local_seq_len": act["local_seq_len"],
        "micro_batch": act["micro_batch"],
        "in_flight": act["in_flight"],
        # bytes this rank sends per layer and micro-step under --tp (forward + backward), tp_nd/comm_plan.py; the
        # grids gather weights and the residual stream before autocast casts them: fp32, an upper bound under --bf16
        "tp_comm": tp_comm_plan(cfg.model_config(), par.dims.tp_mode, par.dims.tp, par.dims.tp_depth,
                                act["micro_batch"] * act["local_seq_len"],
                                compute_bytes if par.dims.tp_mode == "1d" else 4),
        "bytes": {
            "params": params,
            "params_peak": params + extra,
            "grads": grads,
            "optimizer": optimizer,
            "ddp_buckets": ddp_buckets,
            "buffers": buffers,
            "activations": act["activations"],
            "model_state": model_state,
            "host": host,
            "total_peak": model_state - device_off + extra + ddp_buckets + buffers + act["activations"],
        },
    }


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
    from ..pipeline.split_pipeline import parse_split, split_stages

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
