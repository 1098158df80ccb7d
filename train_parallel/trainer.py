"""The training loop, one process or many.

AdamW (weight decay on matrices only), warmup + cosine schedule, gradient
clipping and accumulation, bf16 (autocast, or FSDP's mixed precision), periodic
evaluation (validation loss and bits per byte), ``metrics.jsonl``, checkpoints
that resume bit-exactly under any layout, the final model dir at
``RUN_DIR/model`` and ``RUN_DIR/loss.png``.

Every layout sees the same global batch per step (``--batch-size`` sequences,
split over data-parallel ranks and micro-steps), so any layout trains to the
same losses as one process.

:class:`Trainer` owns a run's state and splits the work into steps (as
torchtitan's does): ``forward_backward_step`` (one optimizer step's gradients),
``train_step`` (learning rate, clipping, the optimizer, the step's record),
``evaluate``, ``after_step`` (metrics, checkpoint) and ``train`` (the loop and
the final model dir, ``_finish``). :func:`train` is the one-call entry point.
"""

from __future__ import annotations

import contextlib
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from prunus.data import Prefetcher, evaluate, get_batch, load_corpus
from prunus.data.instruct import is_instruct_path
from prunus.data.packing import (IGNORE_INDEX, PackedBatch, PackedCorpus, get_packed_batch, load_packed,
                                  packed_eval_batches)
from prunus.data.prefetch import to_device
from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer
from prunus.models.moe import moe_aux_loss, moe_dropped
from prunus.models.quant_registry import is_quantized
from prunus.models.spec import get_spec

from .checkpoint.checkpoint import Checkpointer, list_checkpoints, load_checkpoint, load_model_weights
from .checkpoint.checkpoint_reader import CheckpointUnreadable
from .checkpoint.init_from import init_hf_origin, init_is_quantized, load_init_weights, reset_adapters, run_tokenizer
from .checkpoint.peft_format import save_adapter
from .config import TrainConfig
from .context_parallel.context_parallel import cp_sum, shard_batch
from .data_parallel.data_parallel import apply_ddp
from .data_parallel.modes import dp_mode
from .flops import flops_per_token, peak_memory_bytes, peak_tflops
from .launch.launch import env_ranks, init_distributed, reports_collective_timeouts
from .lora import apply_lora, check_lora, merge_lora
from .metrics import MetricsLog, read_metrics
from .parallel_dims import ParallelDims
from .parallelize import Parallelized, cross_entropy, local_value, resolve_layout
from .pipeline.pipeline_parallel import pipeline_score
from .plot import plot_loss_curves
from .progress import TrainProgress
from .run_dir import check_run_dir, init_run_dir, prior_state, publish_run_dir, raise_run_failure, run_location
from .schedule import lr_at
from .tensor_parallel.tensor_parallel import loss_context
from .train_result import TrainResult


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, zero1_mesh=None) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]  # LoRA trains matrices alone; DCP cannot save an empty group
    if not groups:
        raise PrunusError("the model has nothing trainable (no parameter requires a gradient)")
    optimizer_class = torch.optim.AdamW
    if getattr(cfg, "offload", False) and cfg.zero in (0, 1):  # ZeRO-Offload (offload.py); FSDP: its CPUOffloadPolicy
        from .data_parallel.offload import OffloadedAdamW

        optimizer_class = OffloadedAdamW
    if zero1_mesh is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=optimizer_class, process_group=zero1_mesh.get_group(),
                                       lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    return optimizer_class(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


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


@dataclass
class MoEStats:
    """One optimizer step's load-balancing loss and dropped routed choices, on this rank."""

    aux: float = 0.0
    dropped: int = 0


def _all_mean(value: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """Sum over pipeline stages (only the last holds the loss), mean over data- and context-parallel ranks
    (context-parallel ranks hold equal shares of the tokens: the mean of their means is the token mean)."""
    if dims.pp_enabled:
        dist.all_reduce(value, group=dims.submesh_group("pp"))
    if dims.dp_cp > 1:
        dist.all_reduce(value, group=dims.submesh_group("dp_cp"))
        value = value / dims.dp_cp
    return value


def _moe_metrics(stats: MoEStats, dims: ParallelDims) -> dict:
    """The step's load-balancing loss (mean over data-parallel ranks) and dropped routed choices (their sum)."""
    totals = torch.tensor([stats.aux, stats.dropped], dtype=torch.float64)
    if dims.dp_enabled:
        dist.all_reduce(totals, group=dims.submesh_group("dp"))
    return {"moe_aux_loss": float(totals[0]) / dims.dp, "moe_dropped": int(totals[1])}


def check_trainable(model: torch.nn.Module, cfg: TrainConfig, world: int) -> int:
    """One line when ``model`` cannot train as ``cfg`` asks: LoRA settings that do not fit it (lora.check_lora),
    a quantized base with no adapters or on several ranks, nothing left to train. Returns the number of adapter
    parameters LoRA trains (0 without LoRA)."""
    quantized = [n for n, m in model.named_modules() if is_quantized(m)]
    if cfg.lora_rank:
        adapted = check_lora(model, cfg)
        if quantized and world > 1:
            raise PrunusError(f"QLoRA: the base holds {len(quantized)} quantized modules ({quantized[0]}, ...), which "
                              "train on one process; drop --nproc / the launcher's extra ranks")
    elif quantized:
        raise PrunusError(f"the model holds {len(quantized)} quantized modules ({quantized[0]}, ...), which cannot be "
                          "trained; add --lora-rank to train adapters over them (QLoRA)")
    if not cfg.lora_rank and not any(p.requires_grad for p in model.parameters()):
        raise PrunusError("the model has nothing trainable (every parameter frozen); add --lora-rank to train adapters")
    return sum(cfg.lora_rank * (m.in_features + m.out_features) for m in adapted.values()) if cfg.lora_rank else 0


def load_train_data(cfg: TrainConfig, tokenizer, vocab_size: int):
    """The run's data: a text corpus (token windows), or packed instruction rows for a .jsonl / .parquet --data."""
    if is_instruct_path(cfg.data):
        return load_packed(cfg.data, tokenizer, seq_len=cfg.resolved_seq_len(), vocab_size=vocab_size,
                           train_on_prompt=cfg.train_on_prompt)
    return load_corpus(cfg.data, tokenizer, max_bytes=cfg.max_corpus_bytes, vocab_size=vocab_size)


def preflight(cfg: TrainConfig, *, resume: bool, overwrite: bool) -> None:
    """Every check train() makes before it starts, for ``cfg.nproc`` ranks, without starting them."""
    resolve_layout(cfg, cfg.nproc)
    check_run_dir(cfg, resume=resume, overwrite=overwrite, quiet=True)
    model_cfg = cfg.model_config()
    load_train_data(cfg, run_tokenizer(cfg, model_cfg.vocab_size), model_cfg.vocab_size)


def warmup_warning(cfg: TrainConfig) -> str | None:
    """One line when the warmup outlasts the run (its learning rate never reaches --lr), else None."""
    if cfg.warmup_steps <= cfg.steps:
        return None
    reached = lr_at(cfg.steps - 1, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
    return (f"warning: --warmup-steps {cfg.warmup_steps} exceeds --steps {cfg.steps}: the learning rate only reaches "
            f"{reached:.2e} of --lr {cfg.lr:.2e} and never decays; lower --warmup-steps")


def _check_launch(cfg: TrainConfig, objective) -> tuple[TrainConfig, ParallelDims]:
    """The run's layout for the ranks the launcher started; refused before any process waits on another."""
    cfg.validate()
    world = env_ranks()[1]
    if cfg.nproc > 1 and world != cfg.nproc:
        raise PrunusError(f"--nproc {cfg.nproc} but the launcher started {world} processes (WORLD_SIZE / SLURM_NTASKS); make them agree")
    cfg, dims = resolve_layout(cfg, world)
    if objective is not None and (dims.tp_enabled or dims.pp_enabled):
        raise PrunusError("a training objective other than cross-entropy runs on data-parallel layouts only; set --tp 1 --pp 1")
    if objective is not None and dims.cp_enabled:
        raise PrunusError("a training objective other than cross-entropy sees whole sequences; set --cp 1")
    if is_instruct_path(cfg.data) and dims.cp_enabled:
        raise PrunusError(f"--data {cfg.data}: packed instruction rows need a per-document attention mask, which "
                          "context parallelism does not apply; set --cp 1")
    return cfg, dims


@contextlib.contextmanager
def loss_modules_attached(model: torch.nn.Module, modules: dict[str, torch.nn.Module]):
    """The objective's trainable modules as submodules of ``model`` for as long as the run lasts.

    Attached, every data-parallel layout wraps, synchronises, shards and checkpoints them with the model's own
    parameters (DDP and FSDP act on the module they wrap, and the objective calls its modules directly, outside
    the model's forward); they leave the model when the run ends, on an error too, so the model dir holds the
    model alone."""
    for name, module in modules.items():
        model.register_module(name, module)
    try:
        yield
    finally:
        for name in modules:
            delattr(model, name)


class Trainer:
    """One run (or its resumption) on this rank: the layout, the parallelized model, its optimizers, the data,
    the run dir and the step's state. Build it, then call :meth:`train`; see the module docstring.

    ``model``: start from these weights (its config must be ``cfg.model_config()``) instead of a fresh
    initialisation. ``objective``: replaces cross-entropy as ``objective(logits, x, y) -> loss`` (distillation,
    say; any frozen teacher it holds stays on every rank); the modules it trains,
    ``objective.modules() -> {name: module}``, train with the model (:func:`loss_modules_attached`)."""

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False,
                 model: Transformer | None = None, objective=None):
        cfg, dims = _check_launch(cfg, objective)  # a bad layout fails here, before any process waits on another
        self.rank, self.world, launched_device = init_distributed(cfg.timeout_s)
        self.main = self.rank == 0
        self.cfg, self.dims, self.objective = cfg, dims, objective
        self.spec = get_spec(cfg.KIND)  # the model kind's entries (prunus.models.spec): layout, model dir
        self.model_cfg = cfg.model_config()
        self._locate_run(resume, overwrite)
        self._barrier()  # every rank has checked the run dir before rank 0 writes to it
        self.seq_len = cfg.resolved_seq_len()
        self.tokenizer = run_tokenizer(cfg, self.model_cfg.vocab_size)
        self.corpus = load_train_data(cfg, self.tokenizer, self.model_cfg.vocab_size)
        self.packed = isinstance(self.corpus, PackedCorpus)
        self.device = resolve_device(cfg.device, launched_device)
        self.token_bytes = self.tokenizer.token_bytes()
        self.dp_rank, self.pp_group, self.cp_mesh = dims.submesh_rank("dp"), dims.submesh_group("pp"), dims.submesh("cp")
        self.model = self._build_model(model)
        self.adapter_params = check_trainable(self.model, cfg, self.world)
        self._loss_modules = contextlib.ExitStack()
        self._loss_modules.enter_context(loss_modules_attached(self.model, dict(objective.modules()) if objective else {}))
        try:
            self.par: Parallelized = self._parallelize()
            # what forward calls: the part, or the data-parallel mode's wrapper of it (nn.DataParallel's replicas)
            self.forward_module = dp_mode(cfg).forward_module(self.par.parts[0])
            self.optimizers = [build_optimizer(part, cfg, dims.zero1_mesh) for part in self.par.parts]
            self.checkpointer = Checkpointer(self.run_dir, cfg.keep_checkpoints, use_async=cfg.async_checkpoint)
            self.start, self.train_state = self._load_checkpoint(self.par.parts)
            self._init_run_dir({"model": self.model_cfg.to_dict(), "corpus": self.corpus.name,
                                "train_tokens": len(self.corpus.train), "val_tokens": len(self.corpus.val),
                                "world_size": self.world, "command": shlex.join(sys.argv)})
        except BaseException as e:
            self._loss_modules.close()
            self._raise_failure(e)
        self.stop = cfg.stop_at or cfg.steps
        fsdp_casts = dims.fsdp_enabled  # FSDP's mixed precision casts instead of autocast
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if cfg.bf16 and not fsdp_casts
                         else contextlib.nullcontext())
        self.local_batch = cfg.batch_size // (dims.dp * cfg.grad_accum)
        self.step_flops = flops_per_token(self.model_cfg, self.seq_len) * cfg.tokens_per_step
        self.peak = peak_tflops(self.device, cfg.peak_tflops)
        self.losses: list[float] = []  # training loss of each step run in this invocation
        self.record: dict = {}  # the last step's record
        self.progress = TrainProgress(cfg.steps, self.start, enabled=cfg.progress and self.main, log_every=cfg.log_every)

    # -- setup ---------------------------------------------------------------------------------------------------

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def _build_model(self, model: Transformer | None) -> Transformer:
        torch.manual_seed(self.cfg.seed)
        if model is None and self.cfg.init_from is not None:
            if init_is_quantized(self.cfg.init_from):  # QLoRA: the quantized base as stored, on one process
                from prunus.models import load_model

                return load_model(self.cfg.init_from)
            with torch.device("meta"):  # weights come after the layout: see _parallelize
                model = Transformer(self.model_cfg)
            model.hf_origin = init_hf_origin(self.cfg.init_from)  # a converted model stays exportable to its family
            return model
        if model is None:
            model = Transformer(self.model_cfg)
            model.init_weights()
        elif model.config != self.model_cfg:
            raise ValueError(f"train(model=...): its config {model.config} is not the run's {self.model_cfg}")
        return model

    def _parallelize(self) -> Parallelized:
        """The layout applied to the model. ``--init-from``: applied on the meta device, then each rank allocates
        and reads only its own slices (:mod:`.init_from`); a resumed run's checkpoint fills them instead."""
        model, dims, cfg = self.model, self.dims, self.cfg
        if not any(p.is_meta for p in model.parameters()):
            model.to(self.device).train()
            return self.spec.load("parallelize")(model, dims, cfg, self.device)
        model.train()
        par = self.spec.load("parallelize")(model, dims, cfg, self.device, wrap_ddp=False)  # DDP wraps materialized weights only
        load_init_weights(par.parts, cfg.init_from, self.device, load=self.resume_from is None)
        reset_adapters(par.parts, cfg)  # LoRA adapters built on the meta device: their initial values
        if dims.ddp_enabled:
            par.parts[0] = apply_ddp(par.parts[0], dims.data_parallel_mesh)
        return par

    def _load_checkpoint(self, parts) -> tuple[int, dict]:
        """(the first step to run, the train state: tokens and elapsed seconds so far), ``parts`` and the
        optimizers loaded from the checkpoint resumed; a damaged or misfitting one is one line."""
        if self.resume_from is None:
            return 0, {"tokens": 0, "elapsed_s": 0.0}
        try:
            state = load_checkpoint(self.resume_from, parts, self.optimizers)
        except (CheckpointException, RuntimeError, ValueError, KeyError) as e:
            cause = next(iter(e.failures.values()), (e,))[0] if isinstance(e, CheckpointException) else e
            reason = str(cause).strip().splitlines()[0][:160] if str(cause).strip() else type(cause).__name__
            if isinstance(cause, CheckpointUnreadable):
                raise PrunusError(f"--resume: {self.resume_from} is damaged ({reason}); "
                                  "delete it to resume from an earlier checkpoint, or start a new run") from None
            raise PrunusError(f"--resume: {self.resume_from} does not fit this model ({reason}); "
                              "resume with the model it was written for") from None
        return state.pop("step"), state

    def _locate_run(self, resume: bool, overwrite: bool) -> None:
        """The dir this invocation writes (OUT, or a staging dir that replaces OUT once complete: --overwrite) and
        the checkpoint it resumes from, checked; nothing is written yet."""
        self.run_dir, resume, overwrite = run_location(self.cfg, resume=resume, overwrite=overwrite)
        self.resume_from = check_run_dir(self.cfg, resume=resume, overwrite=overwrite, run_dir=self.run_dir)
        self.fresh_dir = overwrite and not resume  # an overwriting run's staging dir, made anew
        self.prior: str | None = None  # what the run dir was before rank 0 first wrote to it (run_dir.prior_state)

    def _init_run_dir(self, extra: dict) -> None:
        """The run dir and its run.json (``extra``: what the kind records beside the settings), made by rank 0."""
        if self.main:
            self.prior = prior_state(self.run_dir, self.cfg)
            init_run_dir(self.cfg, overwrite=self.fresh_dir, run_dir=self.run_dir, extra=extra)
        self._barrier()

    # -- one step ------------------------------------------------------------------------------------------------

    def step_batches(self, step: int) -> list:
        """This rank's micro-batches of optimizer step ``step`` (a pure function of the seed and the step):
        ``(x, y)`` of a text corpus, a :class:`~prunus.data.packing.PackedBatch` of instruction rows."""
        cfg = self.cfg
        if self.packed:
            return [get_packed_batch(self.corpus.train, seed=cfg.seed, step=step, micro_batch=self.local_batch,
                                     grad_accum=cfg.grad_accum, micro=m, rank=self.dp_rank, world=self.dims.dp)
                    for m in range(cfg.grad_accum)]
        return [get_batch(self.corpus.train, seed=cfg.seed, step=step, micro_batch=self.local_batch,
                          seq_len=self.seq_len, grad_accum=cfg.grad_accum, micro=m, rank=self.dp_rank,
                          world=self.dims.dp) for m in range(cfg.grad_accum)]

    def loss(self, logits: torch.Tensor, x: torch.Tensor, y: torch.Tensor, n_trained: int | None = None) -> torch.Tensor:
        """The micro-batch's loss. Packed batches (``n_trained``: trained targets in the global batch): the
        sum over this micro-batch's trained targets, scaled so that the gradients averaged over data-parallel
        ranks and micro-steps are those of the global batch's token mean, under any layout."""
        if self.objective is not None:
            return self.objective(logits, x, y)
        ce = self.par.loss_fn or cross_entropy  # 2d / 2.5d / 3d tp: the grid's vocabulary-parallel loss
        if n_trained is None:
            return ce(logits, y)
        return ce(logits, y, reduction="sum") * (self.dims.dp * self.cfg.grad_accum / max(n_trained, 1))

    def model_inputs(self, batch) -> tuple:
        """``(inputs, targets, the model's keyword arguments, trained targets in the global batch or None)`` of
        one micro-batch: a packed batch as it is (its documents masked), a text batch cut to this rank's chunks
        of the sequences under context parallelism."""
        if isinstance(batch, PackedBatch):
            return batch.inputs, batch.targets, batch.model_kwargs(), batch.n_trained
        x, y, positions = shard_batch(*batch, self.cp_mesh)
        return x, y, {"positions": positions}, None

    def forward_backward_step(self, micro_batches) -> tuple[torch.Tensor, MoEStats]:
        """Gradients of one optimizer step; returns (the mean loss on this rank, its MoE statistics)."""
        if self.par.schedule is not None:
            return self._pipeline_forward_backward(micro_batches[0]), MoEStats()
        part, accum, moe = self.par.parts[0], self.cfg.grad_accum, MoEStats()
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            x, y, kwargs, n_trained = self.model_inputs(batch)
            sync = not self.par.ddp or i == len(micro_batches) - 1
            with (contextlib.nullcontext() if sync else part.no_sync()), loss_context(self.par.loss_parallel):
                with self.autocast:
                    logits = self.forward_module(x, **kwargs)
                loss = self.loss(logits, x, y, n_trained)
                # mixture of experts: the load-balancing loss joins the gradient
                aux = moe_aux_loss(part) if self.model_cfg.n_experts else None
                ((loss if aux is None else loss + aux) / accum).backward()
            total += local_value(loss).detach().float()
            if aux is not None:
                moe.aux += float(aux.detach()) / accum
            if self.model_cfg.n_experts:
                moe.dropped += moe_dropped(part)
        return total / accum, moe

    def _pipeline_forward_backward(self, batch) -> torch.Tensor:
        losses, par, kwargs = [], self.par, {}
        if isinstance(batch, PackedBatch):  # every stage masks by document; the loss is scaled as in :meth:`loss`
            x, y = batch.inputs, batch.targets
            kwargs = {**batch.model_kwargs(),
                      "loss_kwargs": {"scale": self.dims.dp * self.cfg.microbatches / max(batch.n_trained, 1)}}
        else:
            x, y = batch
        with self.autocast:
            par.schedule.step(*((x,) if par.has_first else ()), target=y if par.has_last else None, losses=losses,
                              **kwargs)
        if par.has_last:
            return torch.stack([local_value(l).detach().float() for l in losses]).mean()
        return torch.zeros((), device=self.device)

    def _set_lr(self, step: int) -> float:
        cfg = self.cfg
        lr = lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        return lr

    def optimizer_step(self, parts) -> float:
        """Clip the gradients of ``parts`` (the whole model's norm, over pipeline stages), step the optimizers and
        clear the gradients; returns the norm before clipping."""
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = clip_grad_norm(parts, clip, self.dims.submesh_group("pp"))
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return grad_norm

    def train_step(self, step: int, micro_batches) -> dict:
        """One optimizer step (0-based ``step``); returns its record for metrics.jsonl."""
        cfg = self.cfg
        t0 = time.perf_counter()
        lr = self._set_lr(step)
        loss, moe = self.forward_backward_step(micro_batches)
        grad_norm = self.optimizer_step(self.par.parts)
        loss_val = float(_all_mean(loss, self.dims)) if self.world > 1 else float(loss)
        dt = time.perf_counter() - t0
        done = step + 1
        self.train_state["tokens"] += cfg.tokens_per_step
        self.train_state["elapsed_s"] += dt
        self.losses.append(loss_val)
        record = {"step": done, "loss": loss_val, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": cfg.tokens_per_step / dt, "elapsed_s": self.train_state["elapsed_s"],
                  "tokens": self.train_state["tokens"]}
        if self.model_cfg.n_experts:
            record.update(_moe_metrics(moe, self.dims))
        if self.peak:
            record["mfu"] = self.step_flops / dt / (self.world * self.peak * 1e12)
        if done % cfg.log_every == 0 or done == self.stop:
            record["peak_mem_bytes"] = rank_peaks(self.device, self.world)
        if done % cfg.eval_every == 0 or done == self.stop:
            record.update(self.evaluate())
        self.record = record
        return record

    # -- evaluation, checkpoints, logging ------------------------------------------------------------------------

    def score(self, x: torch.Tensor, y: torch.Tensor, **docs) -> float:
        """Summed negative log-likelihood of one evaluation batch, the same on every rank (targets equal to
        ``IGNORE_INDEX`` left out). ``docs``: packed documents' ``positions`` and ``doc_ids``."""
        def nll(logits, targets):
            return float((self.par.loss_fn or cross_entropy)(local_value(logits), targets, reduction="sum"))

        par = self.par
        if par.schedule is not None:
            return pipeline_score(par.parts, par.stage_ids, par.n_stages, self.cfg.pp_schedule, self.pp_group, x, y, nll,
                                  **docs)
        if docs:
            return nll(par.parts[0](x, **docs), y)
        x, y, positions = shard_batch(x, y, self.cp_mesh)
        return cp_sum(nll(par.parts[0](x, positions=positions), y), self.cp_mesh)

    def evaluate(self) -> dict:
        """Validation loss and bits per byte of the model as it is now."""
        for p in self.par.parts:
            p.eval()
        if self.packed:
            result = self._evaluate_packed()
        else:
            result = evaluate(None, self.corpus.val, self.token_bytes, seq_len=self.seq_len,
                              batch_size=self.local_batch * self.cfg.grad_accum, max_tokens=self.cfg.eval_tokens,
                              device=self.device, score=self.score)
        for p in self.par.parts:
            p.train()
        return result

    @torch.no_grad()
    def _evaluate_packed(self) -> dict:
        """Held-out instruction rows: loss per trained target, bits per byte of those targets."""
        nll, n_tok, n_bytes = 0.0, 0, 0
        for batch in packed_eval_batches(self.corpus.val, batch_size=self.local_batch * self.cfg.grad_accum,
                                         max_tokens=self.cfg.eval_tokens):
            batch = to_device(batch, self.device)
            nll += self.score(batch.inputs, batch.targets, **batch.model_kwargs())
            kept = batch.targets[batch.targets != IGNORE_INDEX].cpu()
            n_tok += kept.numel()
            n_bytes += int(self.token_bytes[kept].sum())
        return {"val_loss": nll / max(n_tok, 1), "val_bpb": nll / math.log(2) / max(n_bytes, 1), "val_tokens": n_tok,
                "seq_len": self.seq_len}

    def checkpoint_due(self, done: int) -> bool:
        """Whether step ``done`` is checkpointed: every --ckpt-every, and at --stop-at."""
        cfg = self.cfg
        return bool(cfg.ckpt_every and done % cfg.ckpt_every == 0) or (done == self.stop and self.stop < cfg.steps)

    def after_step(self, record: dict, metrics: MetricsLog | None) -> None:
        """The step's record logged, then its checkpoint when due, and at the end of a multi-rank run (the model
        dir is consolidated from it)."""
        if metrics is not None:
            metrics.write(record)
        self.progress.update(record)
        done = record["step"]
        if self.checkpoint_due(done) or (self.world > 1 and done == self.cfg.steps):
            self.checkpointer.save(done, self.par.parts, self.optimizers, self.train_state)

    def _announce(self) -> None:
        cfg, dims = self.cfg, self.dims
        self.progress.print(f"training {self.model_cfg.num_params():,} parameters on {self.corpus.name}: "
                            f"{len(self.corpus.train):,} train tokens, steps {self.start + 1}..{self.stop} of {cfg.steps}, "
                            f"{cfg.tokens_per_step:,} tokens per step, {self.world} x {self.device}"
                            + (f", layout {dims.describe()}" if self.world > 1 else "")
                            + (f"; LoRA rank {cfg.lora_rank}: {self.adapter_params:,} adapter parameters trained, the rest "
                               "frozen" if cfg.lora_rank else ""))
        notes = [warmup_warning(cfg), self.corpus.truncation_note(self.seq_len) if self.packed else None]
        for warning in notes:
            if warning and self.main:
                self.progress.console.print(warning, highlight=False, markup=False, soft_wrap=True)  # one line

    # -- the run -------------------------------------------------------------------------------------------------

    def train(self) -> TrainResult:
        """Run steps start..stop, then (at the last step) write the model dir; publish the run dir."""
        try:
            with self._loss_modules:  # the objective's modules leave the model before it is saved
                self._run_steps()
            return self._finish()
        except BaseException as e:
            self._raise_failure(e)

    def _raise_failure(self, e: BaseException):
        """Re-raise ``e`` once rank 0 has removed what this invocation wrote when nothing complete is in the run dir
        (:func:`.run_dir.discard_incomplete_run`); a write the disk refused becomes one line saying what is left."""
        raise_run_failure(e, self.run_dir, self.prior if self.main else None, self.cfg.out)  # other ranks: not theirs

    def _run_steps(self) -> None:
        metrics = MetricsLog(self.run_dir, resume_step=self.start if self.resume_from is not None else None) if self.main else None
        self._announce()
        prefetch = Prefetcher(self.step_batches, range(self.start, self.stop), device=self.device)
        try:
            with self.progress:
                for step, batch in prefetch:
                    self.after_step(self.train_step(step, batch), metrics)
            self.checkpointer.wait()  # the last checkpoint is published before the model dir is made from it
        finally:
            prefetch.close()
            if metrics is not None:
                metrics.close()

    def save_model(self, record: dict) -> Path:
        """The model dir at RUN_DIR/model (rank 0), consolidated from the final checkpoint when sharded; LoRA
        adapters merged into it (and written in PEFT's format at RUN_DIR/adapter under --save-adapter)."""
        model = self.model
        if self.world > 1:  # consolidate from the final (sharded) checkpoint in this process
            model = Transformer(self.model_cfg)
            if self.cfg.lora_rank:
                apply_lora(model, self.cfg)
            load_model_weights(list_checkpoints(self.run_dir)[-1][1], model)
        if getattr(self.model, "hf_origin", None) and not getattr(model, "hf_origin", None):
            model.hf_origin = self.model.hf_origin  # the consolidated copy keeps the source's family
        if self.cfg.lora_rank:
            model.hf_origin = getattr(self.model, "hf_origin", None)
            if self.cfg.save_adapter:
                save_adapter(model, self.cfg, self.run_dir / "adapter")
            model = merge_lora(model)
        model_dir = self.spec.load("model_dir_writer")(
            model.cpu(), self.run_dir / "model", tokenizer=self.tokenizer, stage="train", overwrite=True,
            parent=self.cfg.init_from,  # fine-tuning: the manifest names the model dir it started from
            metrics={"val_loss": record["val_loss"], "val_bpb": record["val_bpb"], "train_steps": self.stop,
                     "train_tokens": self.train_state["tokens"], "corpus": self.corpus.name, "world_size": self.world,
                     **({"val_tokens": record["val_tokens"]} if "val_tokens" in record else {})},
        )
        # the tokens scored (--eval-tokens) are named: prunus eval scores its own, shorter slice by default
        scored = f" on {record['val_tokens']:,} held-out tokens" if "val_tokens" in record else ""
        self.progress.print(f"model dir: {Path(self.cfg.out) / 'model'}  (val loss {record['val_loss']:.4f}, "
                            f"{record['val_bpb']:.3f} bits/byte{scored})")
        return model_dir

    def _finish(self) -> TrainResult:
        cfg, record, model_dir = self.cfg, self.record, None
        if self.main:
            plot_loss_curves(read_metrics(self.run_dir), self.run_dir / "loss.png", title=f"prunus train ({cfg.preset or Path(cfg.init_from or 'small').name})")
        if self.stop == cfg.steps:
            if not record:  # resumed at the very end: evaluate what was loaded
                record = {"step": self.stop, **self.evaluate()}
            if self.main:
                model_dir = self.save_model(record)
        else:
            self.progress.print(f"stopped at step {self.stop}; continue with --resume")
        self._barrier()
        if self.main:
            run_dir = publish_run_dir(cfg, self.run_dir)  # an overwritten run's old dir goes only now
            model_dir = run_dir / "model" if model_dir is not None else None
        return TrainResult(Path(cfg.out), model_dir, self.stop, record, self.losses)


@reports_collective_timeouts  # a hung rank: one line naming the rank and the collective
def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, model: Transformer | None = None,
          objective=None) -> TrainResult:
    """Run (or resume) a training run described by ``cfg``: ``Trainer(cfg, ...).train()`` (see :class:`Trainer`), or
    the loop of its data-parallel mode where that mode runs its own (:mod:`.data_parallel.modes`)."""
    if dp_mode(cfg).own_loop:  # --dp-mode ps: servers and workers run their own loop (data_parallel/ps_worker.py)
        from .data_parallel.ps_worker import train_ps_mode

        return train_ps_mode(cfg, resume=resume, overwrite=overwrite, model=model, objective=objective)
    return Trainer(cfg, resume=resume, overwrite=overwrite, model=model, objective=objective).train()
