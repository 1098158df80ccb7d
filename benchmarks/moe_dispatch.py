"""MoE dispatch overhead: one MoE layer beside a dense SwiGLU of equal active parameters.

Single process: tokens/s of forward + backward of one ``MoE`` layer (router,
top-k, grouping by expert, the experts, weighted combine; ``n_experts``
experts of hidden ``h``) and of one dense SwiGLU of hidden ``top_k * h`` (the
same matmul FLOPs per token), on the same tokens, interleaved, median of the
repeats; prints MoE / dense. A second MoE row with a capacity factor shows
the cost of dropping.

Two ranks (gloo, one thread each, one spawn): every rank runs the same layer
on its own tokens, once with expert parallelism (ep=2: half the experts per
rank, tokens exchanged by two all-to-alls per direction) and once without
(ep=1: every rank holds every expert, no communication); prints ep=2 / ep=1.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.moe_dispatch [--tokens 2048] [--repeats 15] [--no-ep]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import torch

from prunus.models import ModelConfig
from prunus.models.llama import FeedForward
from prunus.models.moe import MoE


def layer_config(args, **changes) -> ModelConfig:
    return ModelConfig(dim=args.dim, n_layers=1, n_heads=8, n_experts=args.experts, top_k=args.top_k,
                       moe_ffn_dim=args.hidden, moe_aux_loss_coef=0.01, **changes)


def fwd_bwd_seconds(layer: torch.nn.Module, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    out = layer(x)
    loss = out.float().pow(2).mean()
    if getattr(layer, "aux_loss", None) is not None:
        loss = loss + layer.aux_loss
    loss.backward()
    layer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def build(args):
    torch.manual_seed(0)
    layers = {
        "dense SwiGLU (hidden top_k*h)": FeedForward(args.dim, args.top_k * args.hidden),
        "MoE": MoE(layer_config(args)),
        "MoE, capacity 1.25": MoE(layer_config(args, capacity_factor=1.25)),
    }
    for layer in layers.values():
        for p in layer.parameters():
            torch.nn.init.normal_(p, 0.0, 0.02)
        layer.train()
    return layers


def single_process(args) -> dict[str, float]:
    torch.set_num_threads(args.threads)
    layers = build(args)
    x = torch.randn(args.tokens // args.seq, args.seq, args.dim, requires_grad=True)
    for layer in layers.values():  # warm up
        fwd_bwd_seconds(layer, x)
    times = {name: [] for name in layers}
    for _ in range(args.repeats):
        for name, layer in layers.items():
            times[name].append(fwd_bwd_seconds(layer, x))
    return {name: args.tokens / statistics.median(t) for name, t in times.items()}


def _ep_worker(rank: int, args, port: int, out) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from prunus.train_parallel.experts.expert_parallel import apply_ep

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    local, sharded = MoE(layer_config(args)), MoE(layer_config(args))
    for p in local.parameters():
        torch.nn.init.normal_(p, 0.0, 0.02)
    sharded.load_state_dict(local.state_dict())
    apply_ep(sharded, mesh, None, dp=2)
    torch.manual_seed(1 + rank)  # each rank its own tokens
    x = torch.randn(args.tokens // args.seq, args.seq, args.dim, requires_grad=True)
    for layer in (local, sharded):
        layer.train()
        fwd_bwd_seconds(layer, x)
    times = {"ep=1": [], "ep=2": []}
    for _ in range(args.repeats):
        for name, layer in (("ep=1", local), ("ep=2", sharded)):
            dist.barrier()
            times[name].append(fwd_bwd_seconds(layer, x))
    med = torch.tensor([statistics.median(times["ep=1"]), statistics.median(times["ep=2"])], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
    if rank == 0:
        out.put({"ep=1": 2 * args.tokens / float(med[0]), "ep=2": 2 * args.tokens / float(med[1])})
    dist.destroy_process_group()


def two_ranks(args) -> dict[str, float]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_ep_worker, args=(r, args, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit("the two-rank run failed")
    return out.get()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=384, help="each expert's hidden size")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="threads of the single-process comparison")
    parser.add_argument("--no-ep", action="store_true", help="skip the two-rank expert-parallel comparison")
    args = parser.parse_args(argv)
    print(f"one layer, dim {args.dim}, {args.experts} experts of hidden {args.hidden}, top_k {args.top_k}, "
          f"{args.tokens} tokens, forward + backward, median of {args.repeats}")
    rates = single_process(args)
    dense = rates["dense SwiGLU (hidden top_k*h)"]
    for name, rate in rates.items():
        print(f"  {name:32s} {rate:12,.0f} tokens/s   x{rate / dense:.2f} of dense")
    result = {"single": rates, "moe_over_dense": rates["MoE"] / dense}
    print(f"MoE / dense (equal active parameters): {result['moe_over_dense']:.2f}")
    if not args.no_ep:
        ep = two_ranks(args)
        for name, rate in ep.items():
            print(f"  2 ranks, {name:24s} {rate:12,.0f} tokens/s (both ranks)")
        result["ep"] = ep
        result["ep2_over_ep1"] = ep["ep=2"] / ep["ep=1"]
        print(f"ep=2 / ep=1 on 2 ranks: {result['ep2_over_ep1']:.2f}")
    return result


if __name__ == "__main__":
    main()
