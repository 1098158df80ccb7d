"""Knowledge distillation, trained by the parallel engine (``prunus.train_parallel.train``).

``distill_pass(model, ctx, student=...)`` derives a student from ``model`` (see
``compress/student.py``; ``None`` fine-tunes ``model`` itself, e.g. to recover after
pruning) and trains it against ``ctx.teacher`` with ``DistillObjective`` (``distill_loss.py``)
on the context's training tokens, with the engine's AdamW, warmup + cosine schedule
(warmup: a tenth of the steps, down to lr / 10), gradient clipping and progress display.

* ``nproc=1``: in this process.
* under torchrun / Slurm with ``nproc`` ranks (or inside their process group): every rank
  calls it, the engine runs data-parallel across them (its default layout: FSDP; DDP when
  pruned weights must stay zero), every rank returns the consolidated student.
* ``nproc > 1`` otherwise: teacher, student and tokens are written to a temporary dir and
  ``torchrun --standalone`` runs them on ``nproc`` processes (``distill_spawn.py``); the
  consolidated student is read back.

Defaults scale with the model (:func:`default_schedule`): windows of at most
``DISTILL_WINDOW`` tokens, as many rows (up to 16) as keep the student's logits and their
gradients within ``LOGITS_MEMORY``, and as many steps (20 to 200) as fit ``FLOP_BUDGET``
(6 x student + 2 x teacher parameters per token). The demo model gets 200 steps x 16
rows; SmolLM2-135M (vocabulary 49,152) 2 rows x 512 tokens for about 25 steps.
The loss itself is computed over chunks of positions (``distill_loss.py``).

The engine reads the context's exact training and validation tokens from a temporary
``train.bin`` / ``val.bin`` (for vocabularies above 65,536 ids: ``ctx.data`` is loaded again, with
the engine's default corpus size). The projections of the hidden-state loss are trained with
the student and dropped at the end.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.distributed as dist

from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, load_model
from prunus.models.compression_state import compression_state, set_compression_state
from prunus.train_parallel import TrainConfig, train
from prunus.train_parallel.launch.launch import env_ranks, init_distributed

from .distill_loss import DistillObjective
from .distill_spawn import spawn
from .student import check_float, make_student, teacher_blocks

DISTILL_WINDOW = 512  # tokens per row at most
LOGITS_MEMORY = 1 << 30  # bytes for the student's float32 logits, their gradient and two softmax-sized buffers
FLOP_BUDGET = 2e13  # training FLOPs a default run spends (200 steps x 16 rows of 256 tokens of the 3M demo model)
MIN_STEPS, MAX_STEPS, MAX_ROWS = 20, 200, 16


def default_schedule(student: Transformer, ctx, *, steps: int | None = None, batch_size: int | None = None,
                     seq_len: int | None = None, nproc: int = 1) -> tuple[int, int, int]:
    """(steps, batch_size, seq_len) for a distillation run: what was given, the rest scaled to the
    model (see the module docstring). batch_size stays a multiple of nproc; a given seq_len above the window
    the context and both models allow is refused."""
    limit = min(ctx.seq_len, student.config.max_seq_len, ctx.teacher.config.max_seq_len)
    if seq_len is not None and seq_len > limit:  # given: taken as asked, or refused, never cut short quietly
        raise PrunusError(f"distill: seq_len={seq_len} is above the longest window here, {limit} tokens (the "
                          "evaluation window --seq-len and the models' max_seq_len); give at most that")
    seq_len = min(seq_len or DISTILL_WINDOW, limit)
    if batch_size is None:
        rows = LOGITS_MEMORY // (4 * 4 * student.config.vocab_size * seq_len)
        batch_size = max(nproc, min(MAX_ROWS, rows) // nproc * nproc)
    if steps is None:
        n_student = sum(p.numel() for p in student.parameters())
        n_teacher = sum(p.numel() for p in ctx.teacher.parameters())
        per_step = (6 * n_student + 2 * n_teacher) * batch_size * seq_len
        steps = int(min(MAX_STEPS, max(MIN_STEPS, FLOP_BUDGET // per_step)))
    return steps, batch_size, seq_len


@dataclass
class DistillResult:
    model: Transformer  # the trained student, eval mode, on the context's device
    losses: list[float]  # the training loss of every step
    metrics: dict  # the engine's last record: val_loss, val_bpb of the student, ...


def _check_args(steps, batch_size, lr, temperature, kd_weight, reverse_kl, hidden_weight, nproc) -> None:
    checks = [(steps >= 1, f"steps={steps} must be at least 1"), (batch_size >= 1, f"batch_size={batch_size} must be at least 1"),
              (lr > 0, f"lr={lr} must be positive"), (temperature > 0, f"temperature={temperature} must be positive"),
              (0 <= kd_weight <= 1, f"kd_weight={kd_weight} must be between 0 and 1"),
              (0 <= reverse_kl <= 1, f"reverse_kl={reverse_kl} must be between 0 and 1"),
              (hidden_weight >= 0, f"hidden_weight={hidden_weight} must not be negative"),
              (nproc >= 1, f"nproc={nproc} must be at least 1"),
              (batch_size % nproc == 0, f"batch_size={batch_size} must be a multiple of nproc={nproc}")]
    for ok, msg in checks:
        if not ok:
            raise PrunusError(f"distill: {msg}")


def _write_corpus(ctx, root: Path) -> str | None:
    """The context's token streams as train.bin / val.bin (exactly its tokens); None when ids exceed uint16."""
    if max(int(ctx.train_tokens.max()), int(ctx.val_tokens.max())) > np.iinfo(np.uint16).max:
        return None
    root.mkdir(parents=True)
    np.asarray(ctx.train_tokens, dtype=np.uint16).tofile(root / "train.bin")
    np.asarray(ctx.val_tokens, dtype=np.uint16).tofile(root / "val.bin")
    # the engine's progress and run.json name the corpus the user gave, not this temporary dir
    (root / "corpus.json").write_text(json.dumps({"name": corpus_label(ctx)}))
    return str(root)


def corpus_label(ctx) -> str:
    """What a distillation run's progress calls its corpus: the name of the one compress loaded."""
    return getattr(ctx, "corpus_name", "") or (str(ctx.data) if getattr(ctx, "data", None) else "built-in corpus")


def _train_config(ctx, student: Transformer, work: Path, *, steps, batch_size, seq_len, lr, seed, nproc, zero,
                  progress) -> TrainConfig:
    data = _write_corpus(ctx, work / "corpus")
    tokenizer = None
    if ctx.tokenizer.spec().get("kind") != "byte":
        (work / "tokenizer").mkdir(exist_ok=True)
        ctx.tokenizer.save(work / "tokenizer")
        tokenizer = str(work / "tokenizer")
    return TrainConfig(
        out=str(work / "run"), preset="tiny", model=student.config.to_dict(), data=data if data else ctx.data,
        tokenizer=tokenizer, seq_len=seq_len, batch_size=batch_size, steps=steps, lr=lr, min_lr=lr / 10,
        warmup_steps=steps // 10, eval_every=steps, eval_tokens=ctx.eval_tokens, ckpt_every=0, keep_checkpoints=1,
        log_every=max(1, steps // 20), seed=seed, device=str(ctx.device), progress=progress, nproc=nproc, zero=zero)


def _has_zeros_to_keep(model) -> bool:
    return bool(compression_state(model).sparsity)


def _joined_group(nproc: int) -> tuple[bool, int]:
    """Whether this process runs in a process group of several ranks (launched by torchrun / Slurm: joined, or
    reused), and its size; one line when it disagrees with ``nproc``."""
    if env_ranks()[1] > 1:
        init_distributed()
    in_group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    world = dist.get_world_size() if in_group else 1
    if in_group and world != nproc:
        raise PrunusError(f"distill: nproc={nproc} but this process group has {world} ranks; make them agree")
    return in_group, world


def _shared_work_dir(rank0: bool, in_group: bool) -> Path | None:
    """A temporary dir made by rank 0, the same path on every rank of the group."""
    work = Path(tempfile.mkdtemp(prefix="prunus-distill-")) if rank0 else None
    if in_group:
        box = [str(work) if work else None]
        dist.broadcast_object_list(box, src=0)
        work = Path(box[0])
    return work


def distill(student: Transformer, ctx, *, steps: int | None = None, batch_size: int | None = None, seq_len: int | None = None,
            lr: float = 1e-3, temperature: float = 2.0, kd_weight: float = 0.9, reverse_kl: float = 0.0,
            hidden_weight: float = 0.0, nproc: int = 1, seed: int = 0, zero: int | None = None,
            progress: bool = True, run_dir: str | Path | None = None) -> DistillResult:
    """Train ``student`` against ``ctx.teacher`` (see the module docstring). ``steps``, ``batch_size``,
    ``seq_len``: None scales them to the model (:func:`default_schedule`). ``run_dir``: keep the
    engine's run dir (metrics.jsonl, loss.png) there; by default it is temporary."""
    steps, batch_size, seq_len = default_schedule(student, ctx, steps=steps, batch_size=batch_size, seq_len=seq_len,
                                                  nproc=nproc if isinstance(nproc, int) and nproc >= 1 else 1)
    _check_args(steps, batch_size, lr, temperature, kd_weight, reverse_kl, hidden_weight, nproc)
    if student.config.vocab_size != ctx.teacher.config.vocab_size:
        raise PrunusError(f"distill: the student's vocab_size {student.config.vocab_size} differs from the teacher's "
                          f"{ctx.teacher.config.vocab_size}; logits must share the vocabulary")
    in_group, world = _joined_group(nproc)
    student.train()
    for p in student.parameters():
        p.requires_grad_(True)
    keep_zeros = _has_zeros_to_keep(student)
    projections = hidden_weight > 0 and student.config.dim != ctx.teacher.config.dim
    if (keep_zeros or projections) and nproc > 1:
        # gradient masks act on whole parameters, and the projections run outside the model's
        # forward, where FSDP has resharded them: DDP keeps both whole on every rank
        zero = 0
    loss_args = dict(temperature=temperature, kd_weight=kd_weight, reverse_kl=reverse_kl, hidden_weight=hidden_weight,
                     keep_zeros=keep_zeros, seed=seed)
    channels = compression_state(student).student_channels
    rank0 = not in_group or dist.get_rank() == 0

    work = _shared_work_dir(rank0, in_group)
    try:
        if rank0:
            cfg = _train_config(ctx, student, work, steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed,
                                nproc=nproc, zero=zero, progress=progress)
            if run_dir is not None:
                cfg = dataclasses.replace(cfg, out=str(run_dir))
        if in_group:
            box = [cfg.to_dict() if rank0 else None]
            dist.broadcast_object_list(box, src=0)
            cfg = TrainConfig.from_dict(box[0])
        if nproc == 1 or in_group:
            objective = DistillObjective(ctx.teacher, student, channels=channels, **loss_args)
            try:
                r = train(cfg, model=student, objective=objective, overwrite=run_dir is not None)
            finally:
                objective.close()
            model = student if world == 1 else load_model(Path(cfg.out) / "model", device=ctx.device)
            result = DistillResult(model.eval(), r.losses, r.metrics)
        else:
            model, losses, metrics = spawn(ctx, student, cfg, work, loss_args, channels, nproc)
            result = DistillResult(model.eval(), losses, metrics)
        if in_group:
            dist.barrier()  # every rank has read the consolidated model before the dir goes
        return result
    finally:
        if rank0:
            shutil.rmtree(work, ignore_errors=True)


def distill_pass(model: Transformer, ctx, *, student: str | dict | None = None, steps: int | None = None,
                 batch_size: int | None = None, seq_len: int | None = None, lr: float = 1e-3, temperature: float = 2.0,
                 kd_weight: float = 0.9, reverse_kl: float = 0.0, hidden_weight: float = 0.0, nproc: int = 1,
                 seed: int = 0, progress: bool = True) -> Transformer:
    """The compression pass: ``model`` (or the student derived from it) distilled from ``ctx.teacher``.

    ``student``: None (fine-tune ``model`` itself, in place), ``"keep-every:K"``, ``"depth:N"``, ``"width:F"``, a
    preset name or a dict of model config fields (see ``compress/student.py``). Returns the
    student in eval mode; its CompressionState's ``distillation`` records what was done. ``steps``,
    ``batch_size`` and ``seq_len`` default to :func:`default_schedule` (scaled to the model)."""
    if student is None:
        check_float(model)
        teacher_storage = {p.data_ptr() for p in ctx.teacher.parameters()}
        shared = any(p.data_ptr() in teacher_storage for p in model.parameters())
        learner = copy.deepcopy(model) if shared else model  # never train the teacher itself
    else:
        learner = make_student(model, student, seed=seed)
        parent, own = compression_state(model), compression_state(learner)
        # a derived student keeps the passes and distillation record, no quantization and no sparsity
        own.passes, own.distillation = copy.deepcopy(parent.passes), copy.deepcopy(parent.distillation)
    teacher_params = sum(p.numel() for p in ctx.teacher.parameters())
    steps, batch_size, seq_len = default_schedule(learner, ctx, steps=steps, batch_size=batch_size, seq_len=seq_len,
                                                  nproc=nproc if isinstance(nproc, int) and nproc >= 1 else 1)
    if hasattr(ctx, "note"):
        ctx.note(f"distilled {steps} steps x {batch_size} rows x {seq_len} tokens "
                 f"({steps * batch_size * seq_len:,} training tokens)")
    result = distill(learner, ctx, steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, temperature=temperature,
                     kd_weight=kd_weight, reverse_kl=reverse_kl, hidden_weight=hidden_weight, nproc=nproc, seed=seed,
                     progress=progress)
    state = compression_state(learner).copy()
    out = set_compression_state(result.model, state)
    state.distillation = {
        "student": student, "steps": steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr, "temperature": temperature,
        "kd_weight": kd_weight, "reverse_kl": reverse_kl, "hidden_weight": hidden_weight, "nproc": nproc,
        "teacher_layers": ctx.teacher.config.n_layers, "teacher_blocks": teacher_blocks(student, model.config.n_layers),
        "teacher_params": teacher_params, "student_params": sum(p.numel() for p in out.parameters()),
        "final_loss": result.losses[-1], "val_loss": result.metrics.get("val_loss"), "val_bpb": result.metrics.get("val_bpb"),
    }
    return out

