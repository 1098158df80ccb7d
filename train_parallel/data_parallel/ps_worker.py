"""The worker side of the parameter server, and the run that starts both sides (``--dp-mode ps``).

A worker pulls the parameters from every server, computes the gradients of its share of the global batch
(the same share a DDP rank of the same index would train on), clips them itself in asynchronous mode, and
pushes each server its shard. Rank 0 (server 0) writes the run dir: ``run.json``, ``metrics.jsonl`` (one
record per step, the workers' mean loss, once every worker has pushed it) and the model dir, gathered from the
servers at the end. The protocol and the server are :mod:`.parameter_server`.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from prunus.artifacts.errors import PrunusError
from prunus.data import evaluate, get_batch, load_corpus
from prunus.models import Transformer, load_tokenizer, save_model

from ..launch.launch import init_distributed
from ..metrics import MetricsLog, read_metrics
from .parameter_server import (DONE, HEADER, PAYLOAD, PULL, PUSH, REPLY, ParameterServer, gather_to_rank0, header,
                               shard_plan, validate_ps)
from ..parallelize import cross_entropy
from ..plot import plot_loss_curves
from ..run_dir import check_run_dir, init_run_dir, publish_run_dir, run_location
from ..train_result import TrainResult


class PSWorker:
    """One worker: a full model on its device and the loop of pull, forward / backward, push."""

    def __init__(self, cfg, model: Transformer, owner: list[int], n_servers: int, index: int, n_workers: int,
                 corpus, device: torch.device, group, delay_s: float = 0.0):
        self.cfg, self.model, self.owner, self.n_servers = cfg, model.to(device).train(), owner, n_servers
        self.index, self.n_workers, self.corpus, self.device, self.group = index, n_workers, corpus, device, group
        self.delay_s = delay_s  # a deliberately slow worker (tests of the staleness bound)
        self.params = list(self.model.parameters())
        self.by_server = [[p for p, o in zip(self.params, owner) if o == s] for s in range(n_servers)]
        self.local_batch = cfg.batch_size // (n_workers * cfg.grad_accum)
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.bf16 else contextlib.nullcontext())
        self.losses: list[float] = []

    def pull(self, step: int) -> None:
        """The current parameters from every server (a server holds the reply while the bound forbids it)."""
        for s in range(self.n_servers):
            dist.send(header(PULL, step, worker=dist.get_rank()), dst=s, group=self.group, tag=HEADER)
        with torch.no_grad():
            for s, mine in enumerate(self.by_server):
                flat = torch.empty(sum(p.numel() for p in mine))
                dist.recv(flat, src=s, group=self.group, tag=REPLY)
                torch.nn.utils.vector_to_parameters(flat.to(self.device), mine) if mine else None

    def gradients(self, step: int) -> float:
        """This worker's gradients of step ``step``; returns its mean loss."""
        cfg, total = self.cfg, 0.0
        for m in range(cfg.grad_accum):
            x, y = get_batch(self.corpus.train, seed=cfg.seed, step=step, micro_batch=self.local_batch,
                             seq_len=cfg.resolved_seq_len(), grad_accum=cfg.grad_accum, micro=m, rank=self.index,
                             world=self.n_workers)
            x, y = x.to(self.device), y.to(self.device)
            with self.autocast:
                logits = self.model(x)
            loss = cross_entropy(logits, y)
            (loss / cfg.grad_accum).backward()
            total += float(loss.detach()) / cfg.grad_accum
        if cfg.ps_staleness is not None and cfg.grad_clip > 0:  # asynchronous: each push is clipped on its own
            torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip, foreach=True)
        return total

    def push(self, step: int, loss: float) -> None:
        for s, mine in enumerate(self.by_server):
            dist.send(header(PUSH, step, loss, dist.get_rank()), dst=s, group=self.group, tag=HEADER)
            flat = torch.cat([p.grad.reshape(-1).float() for p in mine]).cpu() if mine else torch.zeros(0)
            dist.send(flat, dst=s, group=self.group, tag=PAYLOAD)
        for p in self.params:
            p.grad = None

    def run(self, steps: int) -> list[float]:
        for step in range(steps):
            self.pull(step)
            loss = self.gradients(step)
            if self.delay_s:
                time.sleep(self.delay_s)
            self.push(step, loss)
            self.losses.append(loss)
        for s in range(self.n_servers):
            dist.send(header(DONE, steps, worker=dist.get_rank()), dst=s, group=self.group, tag=HEADER)
        return self.losses


def _metrics_records(stats, n_workers: int) -> list[dict]:
    """One record per step every worker has pushed: the workers' mean loss."""
    return [{"step": step + 1, "loss": sum(by_worker.values()) / n_workers}
            for step, by_worker in sorted(stats.round_losses.items()) if len(by_worker) == n_workers]


def train_parameter_server(cfg, *, overwrite: bool = False, slow_workers: dict[int, float] | None = None):
    """Run ``cfg`` (``dp_mode="ps"``) on this rank as a server or a worker; see the module docstring.

    ``slow_workers``: {worker index: seconds to sleep each step} (to show the staleness bound). Returns a
    TrainResult; on rank 0 its metrics hold ``ps``: the mode, the largest lead of a worker over the slowest
    at a pull, and the largest staleness of a push in parameter versions."""
    rank, world, device = init_distributed(cfg.timeout_s)
    n_workers = validate_ps(cfg, world)
    n_servers = cfg.ps_servers
    run_dir, _, overwrite = run_location(cfg, resume=False, overwrite=overwrite)
    check_run_dir(cfg, resume=False, overwrite=overwrite, run_dir=run_dir)
    group = dist.new_group(backend="gloo")  # point-to-point messages on the CPU, receivable from any source
    server_group = dist.new_group(list(range(n_servers)), backend="gloo") if n_servers > 1 else None
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model_config())
    model.init_weights()
    named = list(model.named_parameters())
    owner = shard_plan(named, n_servers)
    tokenizer = load_tokenizer(cfg.tokenizer)
    corpus = load_corpus(cfg.data, tokenizer, max_bytes=cfg.max_corpus_bytes, vocab_size=model.config.vocab_size)
    if rank == 0:
        init_run_dir(cfg, overwrite=overwrite, run_dir=run_dir, extra={
            "model": model.config.to_dict(), "corpus": corpus.name, "world_size": world, "command": shlex.join(sys.argv),
            "ps": {"servers": n_servers, "workers": n_workers, "staleness": cfg.ps_staleness}})
    dist.barrier()
    workers = list(range(n_servers, world))
    record: dict = {}
    losses: list[float] = []
    if rank < n_servers:
        server = ParameterServer(cfg, named, owner, rank, workers, group, server_group)
        stats = server.serve()
        gather_to_rank0(server, n_servers, owner, model, group)
        if rank == 0:
            records = _metrics_records(stats, n_workers)
            losses = [r["loss"] for r in records]
            record = _finish(cfg, model, tokenizer, corpus, run_dir, records, stats, n_workers)
    else:
        delay = (slow_workers or {}).get(rank - n_servers, 0.0)
        worker = PSWorker(cfg, model, owner, n_servers, rank - n_servers, n_workers, corpus, device, group, delay)
        losses = worker.run(cfg.steps)
    dist.barrier()
    model_dir = None
    if rank == 0:
        out = publish_run_dir(cfg, run_dir)
        model_dir = out / "model"
    return TrainResult(Path(cfg.out), model_dir, cfg.steps, record, losses)


def _finish(cfg, model, tokenizer, corpus, run_dir: Path, records: list[dict], stats, n_workers: int) -> dict:
    """Rank 0: metrics.jsonl, the final evaluation and the model dir; returns the last record."""
    result = evaluate(model, corpus.val, tokenizer.token_bytes(), seq_len=cfg.resolved_seq_len(),
                      batch_size=cfg.batch_size // n_workers, max_tokens=cfg.eval_tokens)
    ps = {"mode": "sync" if cfg.ps_staleness is None else f"async K={cfg.ps_staleness}", "max_lead": stats.max_lead(),
          "max_staleness_versions": max(stats.staleness_versions, default=0), "server0_wait_s": stats.wait_s}
    last = {**records[-1], **result, "ps": ps}
    metrics = MetricsLog(run_dir)
    try:
        for r in records[:-1]:
            metrics.write(r)
        metrics.write(last)
    finally:
        metrics.close()
    plot_loss_curves(read_metrics(run_dir), run_dir / "loss.png", title=f"prunus train ({cfg.preset}, parameter server)")
    save_model(model.cpu(), run_dir / "model", tokenizer=tokenizer, stage="train", overwrite=True,
               metrics={"val_loss": result["val_loss"], "val_bpb": result["val_bpb"], "train_steps": cfg.steps,
                        "corpus": corpus.name, "world_size": dist.get_world_size(), "ps": ps})
    return last


def train_ps_mode(cfg, *, resume: bool, overwrite: bool, model, objective):
    """``--dp-mode ps``'s run: servers and workers run their own loop (:func:`train_parameter_server`)."""
    refuse_resume(cfg, resume)
    if model is not None or objective is not None:
        raise PrunusError("--dp-mode ps trains a fresh model on cross-entropy; use --dp-mode ddp for this run")
    return train_parameter_server(cfg, overwrite=overwrite)


def refuse_resume(cfg, resume: bool) -> None:
    if resume:
        raise PrunusError("--dp-mode ps writes no checkpoints: start a new run instead of --resume")
