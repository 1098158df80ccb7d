"""Worker for benchmarks/train_scaling.py: several measurements in one process group (one spawn serves many).

    torchrun --standalone --nproc-per-node N benchmarks/_scaling_worker.py SPEC.json OUT.json
    python benchmarks/_scaling_worker.py SPEC.json OUT.json          (one process)

SPEC is a list of {"kind", "name", "config": TrainConfig fields}; kinds:

* ``prunus``: ``train(cfg)``; tokens/s and loss of each step from rank 0's metrics.jsonl;
* ``raw``: a hand-written torch DDP loop (DistributedDataParallel, AdamW, clipping) on the same
  model class, initial weights and batches (prepared off the clock); tokens/s of each step on rank 0;
* ``memory``: prunus's ``parallelize()`` + ``build_optimizer()``, one forward/backward/step, then the
  bytes of parameters, gradients and optimizer state each rank really holds.

Rank 0 writes {name: result or {"error": ...}} to OUT after every job, plus "_env" (threads, world).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from prunus.data import get_batch, load_corpus  # noqa: E402
from prunus.models import Transformer, load_tokenizer  # noqa: E402
from prunus.train_parallel import TrainConfig, lr_at, read_metrics, train  # noqa: E402
from prunus.train_parallel.launch import init_distributed  # noqa: E402
from prunus.train_parallel.parallel_dims import ParallelDims  # noqa: E402
from prunus.train_parallel.parallelize import cross_entropy, parallelize  # noqa: E402
from prunus.train_parallel.trainer import build_optimizer, clip_grad_norm  # noqa: E402


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def run_prunus(cfg: TrainConfig) -> dict:
    r = train(cfg)
    records = read_metrics(cfg.out) if rank_world()[0] == 0 else []
    return {"tokens_per_s": [m["tokens_per_s"] for m in records], "losses": r.losses}


def run_raw(cfg: TrainConfig) -> dict:
    """The DDP loop a person would write in a few minutes: tokens/s (global) of each step, on rank 0."""
    rank, world = rank_world()
    mc = cfg.model_config()
    seq_len = cfg.resolved_seq_len()
    corpus = load_corpus(cfg.data, load_tokenizer(cfg.tokenizer), max_bytes=cfg.max_corpus_bytes, vocab_size=mc.vocab_size)
    torch.manual_seed(cfg.seed)
    model = Transformer(mc)
    model.init_weights()
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    local = cfg.batch_size // world
    batches = [get_batch(corpus.train, seed=cfg.seed, step=s, micro_batch=local, seq_len=seq_len, rank=rank, world=world)
               for s in range(cfg.steps)]
    global_tokens = cfg.batch_size * seq_len
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
        rates.append(global_tokens / (time.perf_counter() - t0))
    mean_losses = torch.tensor(losses, dtype=torch.float64)  # off the clock: the global mean, as prunus logs it
    if world > 1:
        dist.all_reduce(mean_losses)
        mean_losses /= world
    return {"tokens_per_s": rates, "losses": mean_losses.tolist()}


def nbytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def run_memory(cfg: TrainConfig) -> dict:
    """Bytes of parameters, gradients and optimizer state on each rank after one optimizer step."""
    rank, world = rank_world()
    mc = cfg.model_config()
    dims = ParallelDims(world_size=world, dp_replicate=cfg.dp_replicate, dp_shard=cfg.dp_shard, tp=cfg.tp, pp=cfg.pp)
    device = torch.device("cpu")
    torch.manual_seed(cfg.seed)
    model = Transformer(mc)
    model.init_weights()
    par = parallelize(model, dims, cfg, device)
    part = par.parts[0]
    zero1_mesh = dims.submesh("dp") if cfg.zero == 1 and dims.dp > 1 else None
    opt = build_optimizer(part, cfg, zero1_mesh)
    dp_rank = dims.submesh("dp").get_local_rank() if dims.dp > 1 else 0
    # the state's bytes do not depend on the tokens: a synthetic stream spares loading the corpus
    x, y = get_batch(np.arange(100_000) % mc.vocab_size, seed=cfg.seed, step=0,
                     micro_batch=cfg.batch_size // dims.dp, seq_len=cfg.resolved_seq_len(), rank=dp_rank, world=dims.dp)
    logits = part(x)
    # FSDP: parameters it holds gathered (unsharded) from forward to backward, on top of their shards
    gathered = sum(nbytes(p) for p in part.parameters() if not isinstance(p, DTensor)) if cfg.zero in (2, 3) else 0
    cross_entropy(logits, y).backward()
    del logits
    clip_grad_norm([part], cfg.grad_clip)
    opt.step()
    params = list({id(p): p for p in part.parameters()}.values())  # tied weights counted once
    local_opt = opt.optim if hasattr(opt, "optim") else opt  # ZeroRedundancyOptimizer: this rank's shard
    state = [v for s in local_opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    mine = {"rank": rank, "params": sum(nbytes(p) for p in params),
            "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
            "opt_state": sum(nbytes(t) for t in state), "gathered_fwd": gathered,
            "dtensor_params": sum(isinstance(p, DTensor) for p in params), "n_params": len(params)}
    opt.zero_grad(set_to_none=True)
    per_rank = [None] * world
    if world > 1:
        dist.all_gather_object(per_rank, mine)
    else:
        per_rank = [mine]
    return {"world": world, "zero": cfg.zero, "per_rank": per_rank}


KINDS = {"prunus": run_prunus, "raw": run_raw, "memory": run_memory}


def main(spec_path: str, out_path: str) -> None:
    rank, world, _ = init_distributed(600.0)
    results = {"_env": {"world": world, "torch_threads": torch.get_num_threads(),
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")}}
    for job in json.loads(open(spec_path).read()):
        t0 = time.perf_counter()
        try:
            results[job["name"]] = KINDS[job["kind"]](TrainConfig(**job["config"]))
        except Exception as e:  # recorded; the group goes on with the next job
            results[job["name"]] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            print(f"rank {rank}, {job['name']}: {traceback.format_exc()}", file=sys.stderr)
        results[job["name"]]["wall_s"] = time.perf_counter() - t0
        if rank == 0:  # after every job: a later hang keeps these
            with open(out_path, "w") as f:
                json.dump(results, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
