"""The hand-written torch training loop that the training benchmarks set prunus's trainer beside.

What a person would write in a few minutes: the same model class and initial weights
(``cfg.seed``), AdamW with weight decay on matrices only, the warmup + cosine schedule,
gradient clipping, ``DistributedDataParallel`` when several ranks run it, and the same
batches as prunus (``prunus.data.get_batch``), prepared off the clock. Used by
``train_throughput.py`` (one process) and ``_scaling_worker.py`` (DDP).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from prunus.data import get_batch
from prunus.models import Transformer
from prunus.train_parallel import TrainConfig, lr_at


def hand_written_loop(cfg: TrainConfig, tokens, *, rank: int = 0, world: int = 1) -> dict:
    """Train ``cfg.steps`` steps on ``tokens``; ``{"tokens_per_s": global tokens/s of each step (this rank's
    clock), "losses": each step's loss averaged over the ranks (off the clock, as prunus logs it)}``."""
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model_config())
    model.init_weights()
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    seq_len = cfg.resolved_seq_len()
    batches = [get_batch(tokens, seed=cfg.seed, step=s, micro_batch=cfg.batch_size // world, seq_len=seq_len,
                         rank=rank, world=world) for s in range(cfg.steps)]
    rates, losses = [], []
    for step, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        rates.append(cfg.batch_size * seq_len / (time.perf_counter() - t0))
    mean_losses = torch.tensor(losses, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(mean_losses)
        mean_losses /= world
    return {"tokens_per_s": rates, "losses": mean_losses.tolist()}
