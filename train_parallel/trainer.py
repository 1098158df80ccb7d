"""The training loop, one process or many.

AdamW (weight decay on matrices only), warmup + cosine schedule, gradient
clipping and accumulation, bf16 (autocast, or FSDP's mixed precision), periodic
evaluation (validation loss and bits per byte), ``metrics.jsonl``, checkpoints
that resume bit-exactly under any layout, the final model dir at
``RUN_DIR/model`` and ``RUN_DIR/loss.png``.

Every layout sees the same global batch per step (``--batch-size`` sequences,
split over data-parallel ranks and micro-steps), so any layout trains to the
same losses as one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from prunus.data import Prefetcher, evaluate, get_batch, load_corpus
from prunus.models import PrunusError, Transformer, load_tokenizer, save_model
from prunus.models.moe import moe_aux_loss, moe_dropped

from .checkpoint import Checkpointer, list_checkpoints, load_checkpoint, load_model_weights
from .config import TrainConfig
from .context_parallel import cp_sum, shard_batch
from .flops import flops_per_token, peak_memory_bytes, peak_tflops
from .launch import env_ranks, init_distributed, reports_collective_timeouts
from .metrics import MetricsLog, read_metrics
from .parallel_dims import ParallelDims
from .pipeline_parallel import pipeline_score
from .parallelize import cross_entropy, local_value, parallelize, validate_layout
from .plot import plot_loss_curves
from .progress import TrainProgress
from .run_dir import check_run_dir, init_run_dir, publish_run_dir, run_location
from .schedule import lr_at
from .tensor_parallel import loss_context


@dataclass
class TrainResult:
    run_dir: Path
    model_dir: Path | None  # None when the run stopped early (--stop-at), or on ranks other than 0
    step: int
    metrics: dict  # the last record (with the last evaluation's figures)
    losses: list[float]  # training loss of each step run in this invocation


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, zero1_mesh=None) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if zero1_mesh is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=zero1_mesh.get_group(),
                                       lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def resolve_device(name: str, launched_device: torch.device) -> torch.device:
    if name == "auto":
        return launched_device
    return torch.device(name)


def clip_grad_norm(parts, max_norm: float, pp_group=None) -> float:
    """Clip by the norm of all gradients of the whole model, across pipeline stages."""
    params = [p for part in parts for p in part.parameters() if p.grad is not None]
    # DTensor gradients on different meshes (FSDP's dp, expert parallelism's ep) are reduced mesh by mesh
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p)
    norms = [local_value(torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)) for group in by_mesh.values()]
    if len(norms) == 1:
        total = norms[0]
    else:
        total = torch.stack(norms).norm() if norms else torch.nn.utils.get_total_norm([], foreach=True)
    if pp_group is not None:
        total = total.pow(2)
        dist.all_reduce(total, group=pp_group)
        total = total.sqrt()
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return float(total)


def rank_peaks(device: torch.device, world: int) -> list[int]:
    """Peak memory of every rank (a collective when distributed)."""
    mine = torch.tensor([peak_memory_bytes(device)], dtype=torch.int64, device=device)
    if world == 1:
        return mine.tolist()
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [int(t) for t in out]


def _all_mean(value: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """Sum over pipeline stages (only the last holds the loss), mean over data- and context-parallel ranks
    (context-parallel ranks hold equal shares of the tokens: the mean of their means is the token mean)."""
    if dims.pp > 1:
        dist.all_reduce(value, group=dims.submesh("pp").get_group())
    if dims.dp * dims.cp > 1:
        dist.all_reduce(value, group=dims.submesh("dp_cp").get_group())
        value = value / (dims.dp * dims.cp)
    return value


def _moe_metrics(step: dict, dims: ParallelDims) -> dict:
    """The step's load-balancing loss (mean over data-parallel ranks) and dropped routed choices (their sum)."""
    stats = torch.tensor([step["aux"], step["dropped"]], dtype=torch.float64)
    if dims.dp > 1:
        dist.all_reduce(stats, group=dims.submesh("dp").get_group())
    return {"moe_aux_loss": float(stats[0]) / dims.dp, "moe_dropped": int(stats[1])}


def resolve_layout(cfg: TrainConfig, world: int) -> tuple[TrainConfig, ParallelDims]:
    """The validated layout for ``world`` ranks, with the ZeRO stage resolved (3 when sharding, else 0)."""
    dims = ParallelDims(world_size=world, dp_replicate=cfg.dp_replicate, dp_shard=cfg.dp_shard, tp=cfg.tp, pp=cfg.pp,
                       ep=cfg.ep, cp=cfg.cp)
    if cfg.zero is None:  # FSDP shards over dp_shard x cp
        cfg = dataclasses.replace(cfg, zero=3 if dims.dp_shard * dims.cp > 1 else 0)
    validate_layout(dims, cfg, cfg.model_config())
    return cfg, dims


def preflight(cfg: TrainConfig, *, resume: bool, overwrite: bool) -> None:
    """Every check train() makes before it starts, for ``cfg.nproc`` ranks, without starting them."""
    cfg.validate()
    resolve_layout(cfg, cfg.nproc)
    check_run_dir(cfg, resume=resume, overwrite=overwrite, quiet=True)
    model_cfg = cfg.model_config()
    load_corpus(cfg.data, load_tokenizer(cfg.tokenizer), max_bytes=cfg.max_corpus_bytes, vocab_size=model_cfg.vocab_size)


@reports_collective_timeouts  # a hung rank: one line naming the rank and the collective
def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, model: Transformer | None = None,
          objective=None) -> TrainResult:
    """Run (or resume) a training run described by ``cfg``; see the module docstring.

    ``model``: start from these weights (its config must be ``cfg.model_config()``) instead of
    a fresh initialisation. ``objective``: replaces cross-entropy as ``objective(logits, x, y)
    -> loss`` (distillation, say; any frozen teacher it holds stays on every rank). Modules it
    trains, ``objective.modules() -> {name: module}``, are attached to the model for the run, so
    every data-parallel layout synchronises, shards and checkpoints them like the model's own;
    they are not part of the model dir written at the end."""
    cfg.validate()
    world = env_ranks()[1]
    if cfg.nproc > 1 and world != cfg.nproc:
        raise PrunusError(f"--nproc {cfg.nproc} but the launcher started {world} processes (WORLD_SIZE / SLURM_NTASKS); make them agree")
    cfg, dims = resolve_layout(cfg, world)  # a bad layout fails here, before any process waits on another
    if objective is not None and (dims.tp > 1 or dims.pp > 1):
        raise PrunusError("a training objective other than cross-entropy runs on data-parallel layouts only; set --tp 1 --pp 1")
    if objective is not None and dims.cp > 1:
        raise PrunusError("a training objective other than cross-entropy sees whole sequences; set --cp 1")
    rank, world, launched_device = init_distributed(cfg.timeout_s)
    main = rank == 0
    model_cfg = cfg.model_config()
    # the dir this invocation writes: OUT, or a staging dir that replaces OUT once complete (--overwrite)
    run_dir, resume, overwrite = run_location(cfg, resume=resume, overwrite=overwrite)
    resume_from = check_run_dir(cfg, resume=resume, overwrite=overwrite, run_dir=run_dir)
    if world > 1:
        dist.barrier()  # every rank has checked the run dir before rank 0 writes to it
    seq_len = cfg.resolved_seq_len()
    tokenizer = load_tokenizer(cfg.tokenizer)
    corpus = load_corpus(cfg.data, tokenizer, max_bytes=cfg.max_corpus_bytes, vocab_size=model_cfg.vocab_size)
    device = resolve_device(cfg.device, launched_device)
    token_bytes = tokenizer.token_bytes()
    dp_rank = dims.submesh("dp").get_local_rank() if dims.dp > 1 else 0
    pp_group = dims.submesh("pp").get_group() if dims.pp > 1 else None
    cp_mesh = dims.submesh("cp")  # None without context parallelism

    torch.manual_seed(cfg.seed)
    if model is None:
        model = Transformer(model_cfg)
        model.init_weights()
    elif model.config != model_cfg:
        raise ValueError(f"train(model=...): its config {model.config} is not the run's {model_cfg}")
    extras = dict(objective.modules()) if objective is not None else {}
    for name, module in extras.items():
        model.add_module(name, module)
    model.to(device).train()
    par = parallelize(model, dims, cfg, device)
    fsdp = dims.dp * dims.cp > 1 and cfg.zero in (2, 3)
    zero1_mesh = dims.submesh("dp_cp") if cfg.zero == 1 and dims.dp * dims.cp > 1 else None
    optimizers = [build_optimizer(part, cfg, zero1_mesh) for part in par.parts]

    checkpointer = Checkpointer(run_dir, cfg.keep_checkpoints, use_async=cfg.async_checkpoint)
    start, train_state = 0, {"tokens": 0, "elapsed_s": 0.0}
    if resume_from is not None:
        try:
            train_state = load_checkpoint(resume_from, par.parts, optimizers)
        except (CheckpointException, RuntimeError, ValueError, KeyError) as e:
            cause = next(iter(e.failures.values()), (e,))[0] if isinstance(e, CheckpointException) else e
            reason = str(cause).strip().splitlines()[0][:160] if str(cause).strip() else type(cause).__name__
            raise PrunusError(f"--resume: {resume_from} does not fit this model ({reason}); "
                              "resume with the model it was written for") from None
        start = train_state.pop("step")
    if main:
        init_run_dir(cfg, overwrite=overwrite and not resume, run_dir=run_dir, extra={
            "model": model_cfg.to_dict(), "corpus": corpus.name, "train_tokens": len(corpus.train),
            "val_tokens": len(corpus.val), "world_size": world, "command": shlex.join(sys.argv),
        })
    if world > 1:
        dist.barrier()
    log = MetricsLog(run_dir, resume_step=start if resume_from is not None else None) if main else None
    stop = cfg.stop_at or cfg.steps
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cfg.bf16 and not fsdp else contextlib.nullcontext()
    local_batch = cfg.batch_size // (dims.dp * cfg.grad_accum)
    step_flops = flops_per_token(model_cfg, seq_len) * cfg.tokens_per_step
    peak = peak_tflops(device, cfg.peak_tflops)

    def make_step_batches(step: int):
        return [get_batch(corpus.train, seed=cfg.seed, step=step, micro_batch=local_batch, seq_len=seq_len,
                          grad_accum=cfg.grad_accum, micro=m, rank=dp_rank, world=dims.dp) for m in range(cfg.grad_accum)]

    moe_step = {"aux": 0.0, "dropped": 0}  # this step's load-balancing loss and dropped routed choices, on this rank

    def forward_backward(micro_batches) -> torch.Tensor:
        if par.schedule is not None:
            (x, y), losses = micro_batches[0], []
            with autocast:
                par.schedule.step(*((x,) if par.has_first else ()), target=y if par.has_last else None, losses=losses)
            if par.has_last:
                return torch.stack([local_value(l).detach().float() for l in losses]).mean()
            return torch.zeros((), device=device)
        total = torch.zeros((), device=device)
        model_part = par.parts[0]
        moe_step.update(aux=0.0, dropped=0)
        for i, (x, y) in enumerate(micro_batches):
            x, y, positions = shard_batch(x, y, cp_mesh)  # context parallel: this rank's chunks of the sequences
            sync = not par.ddp or i == len(micro_batches) - 1
            with (contextlib.nullcontext() if sync else model_part.no_sync()), loss_context(par.loss_parallel):
                with autocast:
                    logits = model_part(x, positions=positions)
                loss = cross_entropy(logits, y) if objective is None else objective(logits, x, y)
                # mixture of experts: the load-balancing loss joins the gradient
                aux = moe_aux_loss(model_part) if model_cfg.n_experts else None
                ((loss if aux is None else loss + aux) / cfg.grad_accum).backward()
            total += local_value(loss).detach().float()
            if aux is not None:
                moe_step["aux"] += float(aux.detach()) / cfg.grad_accum
            if model_cfg.n_experts:
                moe_step["dropped"] += moe_dropped(model_part)
        return total / cfg.grad_accum

    def score(x, y) -> float:
        """Summed negative log-likelihood of one evaluation batch, the same on every rank."""
        def nll(logits, targets):
            return float(cross_entropy(local_value(logits), targets, reduction="sum"))

        if par.schedule is not None:
            return pipeline_score(par.parts, par.stage_ids, par.n_stages, cfg.pp_schedule, pp_group, x, y, nll)
        x, y, positions = shard_batch(x, y, cp_mesh)
        return cp_sum(nll(par.parts[0](x, positions=positions), y), cp_mesh)

    def run_eval() -> dict:
        for p in par.parts:
            p.eval()
        result = evaluate(None, corpus.val, token_bytes, seq_len=seq_len, batch_size=local_batch * cfg.grad_accum,
                          max_tokens=cfg.eval_tokens, device=device, score=score)
        for p in par.parts:
            p.train()
        return result

    losses: list[float] = []
    record: dict = {}
    progress = TrainProgress(cfg.steps, start, enabled=cfg.progress and main, log_every=cfg.log_every)
    progress.print(f"training {model_cfg.num_params():,} parameters on {corpus.name}: "
                   f"{len(corpus.train):,} train tokens, steps {start + 1}..{stop} of {cfg.steps}, "
                   f"{cfg.tokens_per_step:,} tokens per step, {world} x {device}"
                   + (f", layout dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} cp={dims.cp} tp={dims.tp} pp={dims.pp} "
                      f"zero={cfg.zero}" + (f" ep={dims.ep}" if dims.ep > 1 else "") if world > 1 else ""))
    prefetch = Prefetcher(make_step_batches, range(start, stop), device=device)
    try:
        with progress:
            for step, micro_batches in prefetch:
                t0 = time.perf_counter()
                lr = lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
                for opt in optimizers:
                    for group in opt.param_groups:
                        group["lr"] = lr
                loss = forward_backward(micro_batches)
                max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
                grad_norm = clip_grad_norm(par.parts, max_norm, pp_group)
                for opt in optimizers:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                loss_val = float(_all_mean(loss, dims)) if world > 1 else float(loss)
                dt = time.perf_counter() - t0
                done = step + 1
                train_state["tokens"] += cfg.tokens_per_step
                train_state["elapsed_s"] += dt
                losses.append(loss_val)
                record = {"step": done, "loss": loss_val, "lr": lr, "grad_norm": grad_norm,
                          "tokens_per_s": cfg.tokens_per_step / dt, "elapsed_s": train_state["elapsed_s"],
                          "tokens": train_state["tokens"]}
                if model_cfg.n_experts:
                    record.update(_moe_metrics(moe_step, dims))
                if peak:
                    record["mfu"] = step_flops / dt / (world * peak * 1e12)
                if done % cfg.log_every == 0 or done == stop:
                    record["peak_mem_bytes"] = rank_peaks(device, world)
                if done % cfg.eval_every == 0 or done == stop:
                    record.update(run_eval())
                if main:
                    log.write(record)
                progress.update(record)
                final_consolidation = world > 1 and done == cfg.steps
                if (cfg.ckpt_every and done % cfg.ckpt_every == 0) or (done == stop and stop < cfg.steps) or final_consolidation:
                    checkpointer.save(done, par.parts, optimizers, train_state)
        checkpointer.wait()  # the last checkpoint is published before the model dir is made from it
    finally:
        prefetch.close()
        if log is not None:
            log.close()
    for name in extras:  # the objective's modules belong to the run, not to the model
        delattr(model, name)

    model_dir = None
    if main:
        plot_loss_curves(read_metrics(run_dir), run_dir / "loss.png", title=f"prunus train ({cfg.preset})")
    if stop == cfg.steps:
        if not record:  # resumed at the very end: evaluate what was loaded
            record = {"step": stop, **run_eval()}
        if main:
            if world > 1:  # consolidate from the final (sharded) checkpoint in this process
                model = Transformer(model_cfg)
                load_model_weights(list_checkpoints(run_dir)[-1][1], model)
            model_dir = save_model(
                model.cpu(), run_dir / "model", tokenizer=tokenizer, stage="train", overwrite=True,
                metrics={"val_loss": record["val_loss"], "val_bpb": record["val_bpb"], "train_steps": stop,
                         "train_tokens": train_state["tokens"], "corpus": corpus.name, "world_size": world},
            )
            progress.print(f"model dir: {Path(cfg.out) / 'model'}  (val loss {record['val_loss']:.4f}, {record['val_bpb']:.3f} bits/byte)")
    else:
        progress.print(f"stopped at step {stop}; continue with --resume")
    if world > 1:
        dist.barrier()
    if main:
        run_dir = publish_run_dir(cfg, run_dir)  # an overwritten run's old dir goes only now
        model_dir = run_dir / "model" if model_dir is not None else None
    return TrainResult(Path(cfg.out), model_dir, stop, record, losses)
