"""Single-process training: the loop the parallel engine extends.

AdamW (weight decay on matrices only), warmup + cosine schedule, gradient
clipping and accumulation, optional bf16 autocast, periodic evaluation
(validation loss and bits per byte), ``metrics.jsonl``, checkpoints that resume
bit-exactly, the final model dir at ``RUN_DIR/model`` and ``RUN_DIR/loss.png``.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from prunus.data import Prefetcher, evaluate, get_batch, load_corpus
from prunus.models import Transformer, load_tokenizer, save_model

from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig
from .metrics import MetricsLog, read_metrics
from .plot import plot_loss_curves
from .progress import TrainProgress
from .run_dir import check_run_dir, init_run_dir
from .schedule import lr_at


@dataclass
class TrainResult:
    run_dir: Path
    model_dir: Path | None  # None when the run stopped early (--stop-at)
    step: int
    metrics: dict  # the last record (with the last evaluation's figures)
    losses: list[float]  # training loss of each step run in this invocation


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False) -> TrainResult:
    """Run (or resume) a training run described by ``cfg``; see the module docstring."""
    cfg.validate()
    resume_from = check_run_dir(cfg, resume=resume, overwrite=overwrite)
    model_cfg = cfg.model_config()
    seq_len = cfg.resolved_seq_len()
    tokenizer = load_tokenizer(cfg.tokenizer)
    corpus = load_corpus(cfg.data, tokenizer, max_bytes=cfg.max_corpus_bytes, vocab_size=model_cfg.vocab_size)
    device = resolve_device(cfg.device)
    token_bytes = tokenizer.token_bytes()

    torch.manual_seed(cfg.seed)
    model = Transformer(model_cfg)
    model.init_weights()
    model.to(device).train()
    optimizer = build_optimizer(model, cfg)

    run_dir = Path(cfg.out)
    start, train_state = 0, {"tokens": 0, "elapsed_s": 0.0}
    if resume_from is not None:
        train_state = load_checkpoint(resume_from, model, optimizer)
        start = train_state.pop("step")
    init_run_dir(cfg, overwrite=overwrite and not resume, extra={
        "model": model_cfg.to_dict(), "corpus": corpus.name, "train_tokens": len(corpus.train),
        "val_tokens": len(corpus.val), "command": shlex.join(sys.argv),
    })
    log = MetricsLog(run_dir, resume_step=start if resume_from is not None else None)
    stop = cfg.stop_at or cfg.steps
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cfg.bf16 else contextlib.nullcontext()

    def make_step_batches(step: int):
        return [get_batch(corpus.train, seed=cfg.seed, step=step, micro_batch=cfg.batch_size, seq_len=seq_len,
                          grad_accum=cfg.grad_accum, micro=m) for m in range(cfg.grad_accum)]

    def run_eval() -> dict:
        return evaluate(model, corpus.val, token_bytes, seq_len=seq_len, batch_size=cfg.batch_size,
                        max_tokens=cfg.eval_tokens, device=device)

    losses: list[float] = []
    record: dict = {}
    progress = TrainProgress(cfg.steps, start, enabled=cfg.progress, log_every=cfg.log_every)
    progress.print(f"training {model_cfg.num_params():,} parameters on {corpus.name}: "
                   f"{len(corpus.train):,} train tokens, steps {start + 1}..{stop} of {cfg.steps}, "
                   f"{cfg.tokens_per_step:,} tokens per step, {device}")
    prefetch = Prefetcher(make_step_batches, range(start, stop), device=device)
    try:
        with progress:
            for step, micro_batches in prefetch:
                t0 = time.perf_counter()
                lr = lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss_sum = 0.0
                for x, y in micro_batches:
                    with autocast:
                        logits = model(x)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                    (loss / cfg.grad_accum).backward()
                    loss_sum += loss.item()
                max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                dt = time.perf_counter() - t0
                done = step + 1
                train_state["tokens"] += cfg.tokens_per_step
                train_state["elapsed_s"] += dt
                loss_val = loss_sum / cfg.grad_accum
                losses.append(loss_val)
                record = {"step": done, "loss": loss_val, "lr": lr, "grad_norm": grad_norm,
                          "tokens_per_s": cfg.tokens_per_step / dt, "elapsed_s": train_state["elapsed_s"],
                          "tokens": train_state["tokens"]}
                if done % cfg.eval_every == 0 or done == stop:
                    record.update(run_eval())
                log.write(record)
                progress.update(record)
                if (cfg.ckpt_every and done % cfg.ckpt_every == 0) or (done == stop and stop < cfg.steps):
                    save_checkpoint(run_dir, done, model, optimizer, train_state, keep=cfg.keep_checkpoints)
    finally:
        prefetch.close()
        log.close()

    records = read_metrics(run_dir)
    plot_loss_curves(records, run_dir / "loss.png", title=f"prunus train ({cfg.preset})")
    model_dir = None
    if stop == cfg.steps:
        if not record:  # resumed at the very end: evaluate what was loaded
            record = {"step": stop, **run_eval()}
        model_dir = save_model(
            model.cpu(), run_dir / "model", tokenizer=tokenizer, stage="train", overwrite=True,
            metrics={"val_loss": record["val_loss"], "val_bpb": record["val_bpb"], "train_steps": stop,
                     "train_tokens": train_state["tokens"], "corpus": corpus.name},
        )
        progress.print(f"model dir: {model_dir}  (val loss {record['val_loss']:.4f}, {record['val_bpb']:.3f} bits/byte)")
    else:
        progress.print(f"stopped at step {stop}; continue with --resume")
    return TrainResult(run_dir, model_dir, stop, record, losses)
