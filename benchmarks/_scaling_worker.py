"""Worker for benchmarks/train_scaling.py: several measurements in one process group (one spawn serves many).

    torchrun --standalone --nproc-per-node N benchmarks/_scaling_worker.py SPEC.json OUT.json
    python -m benchmarks._scaling_worker SPEC.json OUT.json          (one process)

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

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import numpy as np
import torch
import torch.distributed as dist
from benchmarks._baseline import hand_written_loop
from torch.distributed.tensor import DTensor

from prunus.data import get_batch, load_corpus
from prunus.artifacts.atomic import atomic_write_json
from prunus.models import Transformer, load_tokenizer
from prunus.train_parallel import TrainConfig, read_metrics, train
from prunus.train_parallel.launch.launch import init_distributed
from prunus.train_parallel.parallelize import cross_entropy, parallelize, resolve_layout
from prunus.train_parallel.trainer import build_optimizer, clip_grad_norm


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def run_prunus(cfg: TrainConfig) -> dict:
    r = train(cfg)
    records = read_metrics(cfg.out) if rank_world()[0] == 0 else []
    return {"tokens_per_s": [m["tokens_per_s"] for m in records], "losses": r.losses}


def run_raw(cfg: TrainConfig) -> dict:
    """The DDP loop a person would write in a few minutes (``_baseline.py``): tokens/s (global) of each step, on rank 0."""
    rank, world = rank_world()
    corpus = load_corpus(cfg.data, load_tokenizer(cfg.tokenizer), max_bytes=cfg.max_corpus_bytes,
                         vocab_size=cfg.model_config().vocab_size)
    return hand_written_loop(cfg, corpus.train, rank=rank, world=world)


def nbytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def run_memory(cfg: TrainConfig) -> dict:
    """Bytes of parameters, gradients and optimizer state on each rank after one optimizer step."""
    rank, world = rank_world()
    mc = cfg.model_config()
    cfg, dims = resolve_layout(cfg, world)
    device = torch.device("cpu")
    torch.manual_seed(cfg.seed)
    model = Transformer(mc)
    model.init_weights()
    par = parallelize(model, dims, cfg, device)
    part = par.parts[0]
    opt = build_optimizer(part, cfg, dims.zero1_mesh)
    dp_rank = dims.submesh_rank("dp")
    # the state's bytes do not depend on the tokens: a synthetic stream spares loading the corpus
    x, y = get_batch(np.arange(100_000) % mc.vocab_size, seed=cfg.seed, step=0,
                     micro_batch=cfg.batch_size // dims.dp, seq_len=cfg.resolved_seq_len(), rank=dp_rank, world=dims.dp)
    logits = part(x)
    # FSDP: parameters it holds gathered (unsharded) from forward to backward, on top of their shards
    gathered = sum(nbytes(p) for p in part.parameters() if not isinstance(p, DTensor)) if dims.fsdp_enabled else 0
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


def run_job(job: dict, rank: int) -> dict:
    """One job's result, or its error (recorded: the group goes on with the next job), with its wall time."""
    t0 = time.perf_counter()
    try:
        result = KINDS[job["kind"]](TrainConfig(**job["config"]))
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        print(f"rank {rank}, {job['name']}: {traceback.format_exc()}", file=sys.stderr)
    return {**result, "wall_s": time.perf_counter() - t0}


def main(spec_path: str, out_path: str) -> None:
    rank, world, _ = init_distributed(600.0)
    results = {"_env": {"world": world, "torch_threads": torch.get_num_threads(),
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")}}
    for job in json.loads(open(spec_path).read()):
        results[job["name"]] = run_job(job, rank)
        if rank == 0:  # after every job: a later hang keeps these
            atomic_write_json(out_path, results)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
