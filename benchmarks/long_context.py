"""Long context: activation memory per rank and tokens/s of context parallelism (ring, Ulysses) beside one process.

At --seq-len (default 2,048) tokens, the ``small`` preset's shape with its context raised to the
sequence, the same initial weights and the same --batch-size sequences per step, in one process group
of 2 ranks (gloo):

* ``cp=1``: one process (rank 0 alone, --threads-one threads, 2 by default: the same cores as the two
  ranks; rank 1 waits);
* ``ring`` and ``ulysses``: ``--cp 2``, one thread per rank, the model's attention swapped by
  ``apply_cp`` and its gradients averaged over the two ranks by DDP (the trainer's --zero 0 layout).

Activation memory: the bytes autograd keeps for backward during one forward and the loss (every
distinct storage a saved tensor lives in, parameters and buffers left out, plus the logits), counted
with ``prunus.train_parallel.launch.saved_activations`` (``saved_tensors_hooks``). That is exact and device-independent; it is not
the allocator's peak (transient buffers such as a ring step's received block are not in it). The
dry run's estimate (``prunus train --dry-run``) is printed beside it. Goal: cp=2 / cp=1 <= 0.6 per rank.

Throughput: median over the timed steps (after --skip warm-up steps, over --rounds alternating rounds)
of forward + backward + AdamW, tokens of the global batch per second. The first step's loss of every
variant is compared with cp=1's (same weights, same batch): context parallelism is exact.

Timings never fail the run. ``OMP_WAIT_POLICY=PASSIVE`` is set for every rank.

    python -m benchmarks.long_context [--seq-len 2048] [--steps 6] [--rounds 2] [--plot runs/long_context.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import torch
from benchmarks.harness import fmt, goal, ratio, show

MiB = 1 << 20
VARIANTS = ("cp1", "ring", "ulysses")


# ---------------------------------------------------------------------------------------------- worker (each rank)

def _saved_bytes(model, x, y, positions) -> tuple[int, float]:
    """(bytes autograd keeps for backward in one forward + loss, the loss); backward then frees them."""
    from prunus.train_parallel.parallelize import cross_entropy
    from prunus.train_parallel.launch.saved_activations import SavedActivations

    with SavedActivations(model) as saved:
        logits = model(x, positions=positions)
        loss = cross_entropy(logits, y)
    saved.add(logits)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return saved.bytes, float(loss)


def _timed_steps(model, batch, steps: int) -> dict:
    """``steps`` training steps of ``model`` on ``batch`` (x, y, positions): the activations its first step saves,
    its first loss and each step's seconds."""
    from torch.nn.parallel import DistributedDataParallel

    from prunus.train_parallel.parallelize import cross_entropy

    xs, ys, positions = batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    saved, first_loss = _saved_bytes(inner, xs, ys, positions)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = cross_entropy(model(xs, positions=positions), ys)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {"saved_bytes": saved, "first_loss": first_loss, "step_s": times}


def worker(spec: dict, out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from prunus.models import Transformer, get_preset
    from prunus.train_parallel.context_parallel.context_parallel import apply_cp, shard_batch

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    cfg = get_preset(spec["preset"]).replace(max_seq_len=spec["seq_len"])
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (spec["batch_size"], spec["seq_len"]), generator=g)
    y = torch.randint(0, cfg.vocab_size, (spec["batch_size"], spec["seq_len"]), generator=g)
    tokens = x.numel()

    def build(variant: str):
        torch.manual_seed(0)
        model = Transformer(cfg)
        model.init_weights()
        if variant == "cp1":
            return model, (x, y, None)
        apply_cp(model, mesh, variant)
        return DistributedDataParallel(model, process_group=mesh.get_group()), shard_batch(x, y, mesh)

    def run(variant: str, steps: int) -> dict:
        return _timed_steps(*build(variant), steps)

    results: dict = {"_env": {"world": world, "threads_one": spec["threads_one"]}}
    for r in range(spec["rounds"]):
        for variant in VARIANTS:
            if variant == "cp1":  # one process on the cores of both ranks; rank 1 waits at the barrier
                if rank == 0:
                    torch.set_num_threads(spec["threads_one"])
                    mine = run(variant, spec["steps"])
                    torch.set_num_threads(1)
                    results.setdefault(variant, []).append({**mine, "saved_bytes": [mine["saved_bytes"]]})
                dist.barrier()
                continue
            torch.set_num_threads(1)
            mine = run(variant, spec["steps"])
            every = [None] * world
            dist.all_gather_object(every, mine["saved_bytes"])
            loss = torch.tensor([mine["first_loss"]], dtype=torch.float64)
            dist.all_reduce(loss)  # the mean of the ranks' token means: the global token mean
            results.setdefault(variant, []).append({"saved_bytes": every, "first_loss": float(loss) / world,
                                                    "step_s": mine["step_s"]})
        if rank == 0:
            Path(out_path).write_text(json.dumps({**results, "_tokens": tokens}))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- sections (parent)

def planned_activations(args, cp: int, impl: str) -> int:
    """The dry run's activation estimate per rank for this benchmark's shape (``prunus train --dry-run``)."""
    from prunus.train_parallel import TrainConfig
    from prunus.train_parallel.launch.dry_run import memory_plan

    cfg = TrainConfig(preset=args.preset, model={"max_seq_len": args.seq_len}, seq_len=args.seq_len,
                      batch_size=args.batch_size, cp=cp, cp_impl=impl, zero=0)
    return memory_plan(cfg, cp)["bytes"]["activations"]


def long_context_section(args) -> dict:
    """Activation memory per rank and tokens/s: cp=1 against --cp 2 ring and Ulysses, measured in one process group."""
    spec = {"preset": args.preset, "seq_len": args.seq_len, "batch_size": args.batch_size, "steps": args.steps,
            "rounds": args.rounds, "threads_one": args.threads_one}
    with tempfile.TemporaryDirectory(prefix="prunus-long-context-") as d:
        spec_path, out = Path(d) / "spec.json", Path(d) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "benchmarks.long_context", "--worker", str(spec_path), str(out)]
        from rich.console import Console

        with Console().status(f"2 ranks: cp=1, ring, Ulysses at {args.seq_len:,} tokens, {args.rounds} round(s) ..."):
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout,
                                  cwd=Path(__file__).resolve().parents[1])
            wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print(f"the 2-rank run failed; figures it did not write are left out:\n{proc.stderr[-3000:]}", file=sys.stderr)
        res = json.loads(out.read_text()) if out.exists() else {}
    tokens = res.get("_tokens", args.batch_size * args.seq_len)

    mem, rate, loss = {}, {}, {}
    for v in VARIANTS:
        runs = res.get(v, [])
        if not runs:
            continue
        mem[v] = max(runs[0]["saved_bytes"])
        times = [t for run in runs for t in run["step_s"][args.skip:]]
        rate[v] = tokens / statistics.median(times) if times else None
        loss[v] = runs[0]["first_loss"]
    plans = {"cp1": planned_activations(args, 1, "ring"), "ring": planned_activations(args, 2, "ring"),
             "ulysses": planned_activations(args, 2, "ulysses")}
    label = {"cp1": f"cp=1 (1 process x {args.threads_one} threads)", "ring": "--cp 2 ring (2 x 1 thread)",
             "ulysses": "--cp 2 ulysses (2 x 1 thread)"}
    print(f"model: {args.preset} shape, context {args.seq_len:,}; global batch {args.batch_size} x {args.seq_len:,} = "
          f"{tokens:,} tokens/step; {args.steps} steps x {args.rounds} round(s), median after {args.skip}; "
          f"load average {os.getloadavg()[0]:.2f}; {wall:.0f} s")
    show("Activation memory per rank (bytes autograd saves for backward) and throughput",
         ["variant", "saved MiB (max rank)", "dry-run MiB", "tokens/s", "first loss - cp=1's"],
         [[label[v], fmt(mem.get(v, None) and mem[v] / MiB, ",.1f"), fmt(plans[v] / MiB, ",.1f"), fmt(rate.get(v)),
           fmt(loss.get(v) - loss["cp1"] if v in loss and "cp1" in loss else None, ".2e")] for v in VARIANTS])

    rows = []
    for v in ("ring", "ulysses"):
        m = ratio(mem.get(v), mem.get("cp1"))
        rows.append([f"activation memory per rank, {v} / cp=1", fmt(m, ".3f"), "<= 0.6", goal(m, lambda x: x <= 0.6)])
    for v in ("ring", "ulysses"):
        rows.append([f"tokens/s, {v} / cp=1", fmt(ratio(rate.get(v), rate.get("cp1")), ".3f"), "", ""])
    rows.append(["tokens/s, ring / ulysses", fmt(ratio(rate.get("ring"), rate.get("ulysses")), ".3f"), "", ""])
    show("Ratios", ["ratio", "value", "goal", "met"], rows)
    return {"label": label, "mem": mem, "plans": plans, "rate": rate}


def plot(result: dict, path: Path, seq_len: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [v for v in VARIANTS if v in result["mem"]]
    if not names:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    a.bar(names, [result["mem"][v] / MiB for v in names], color="tab:blue", label="measured (saved tensors)")
    a.plot(names, [result["plans"][v] / MiB for v in names], "o", color="black", label="dry-run estimate")
    a.set_ylabel("MiB per rank")
    a.set_title(f"activation memory at {seq_len:,} tokens")
    a.legend()
    b.bar(names, [result["rate"][v] or 0 for v in names], color="tab:green")
    b.set_ylabel("tokens/s (global batch)")
    b.set_title("throughput")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


# The sections this benchmark runs, in order. Each takes the parsed arguments and prints its own tables.

def moe_dispatch_section(args) -> dict:
    """MoE dispatch overhead against a dense MLP of equal active parameters (benchmarks/moe_dispatch.py)."""
    from benchmarks import moe_dispatch

    return moe_dispatch.main([])


SECTIONS = [long_context_section, moe_dispatch_section]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", help="model shape; its context is raised to --seq-len")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=1, help="sequences per step (every cp rank holds its chunks of all)")
    ap.add_argument("--steps", type=int, default=6, help="steps per variant and round")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of the three variants")
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps of each round left out of the median")
    ap.add_argument("--threads-one", type=int, default=2, help="threads of the one-process run")
    ap.add_argument("--plot", default="runs/long_context.png")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    if args.skip >= args.steps:
        ap.error(f"--skip {args.skip} leaves no timed step of --steps {args.steps}")
    if args.seq_len % 4:
        ap.error(f"--seq-len {args.seq_len} must be a multiple of 4 (two chunks on each of 2 ranks)")
    for section in SECTIONS:
        result = section(args)
        if section is long_context_section and args.plot:
            plot(result, Path(args.plot), args.seq_len)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(json.loads(Path(sys.argv[2]).read_text()), sys.argv[3])
    else:
        main()
