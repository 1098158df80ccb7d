"""Data-parallel scaling: prunus DDP x 2 beside a hand-written torch DDP loop and one process; ZeRO memory.

Throughput: the same model (the ``small`` preset unless --preset), initial weights, global batch
(--batch-size sequences of --seq-len tokens, split over the ranks) and batches, AdamW and clipping:

* prunus ``train`` with --zero 0 (DDP) on 2 ranks, one thread per rank (tokens/s from rank 0's metrics.jsonl);
* a hand-written torch loop on 2 ranks: DistributedDataParallel, AdamW, clip_grad_norm_, batches from
  ``prunus.data.get_batch`` prepared off the clock (tokens/s on rank 0);
* prunus ``train`` in one process, with 1 thread and with 2 threads.

Each figure is the median tokens/s over the steps after --skip warm-up steps, over --rounds runs
(the two DDP loops alternate in one process group). Ratios printed: prunus DDP / raw DDP (goal >= 0.95)
and prunus DDP x 2 / prunus in one process (goal >= 1.4), against both one-process baselines.

Memory: the bytes of parameters, gradients and optimizer state each rank really holds after one
optimizer step (DTensors by ``to_local()``, ZeRO-1 by ZeroRedundancyOptimizer's local ``.optim``),
for DDP and ZeRO-1/2/3 at 2 and 4 ranks, against DDP and against the ideal 1/N share of what
each stage shards (ZeRO-1: optimizer states; ZeRO-2: + gradients; ZeRO-3: + parameters); goal
measured / ideal <= 1.05.

Ranks run under ``python -m torch.distributed.run --standalone`` (gloo), OMP_WAIT_POLICY=PASSIVE.
Timings never fail the run: it prints what it measured.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.train_scaling [--steps 20] [--rounds 2] [--quick]
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

from benchmarks.harness import fmt, goal, machine_line, ratio, show

from prunus.train_parallel import TrainConfig

WORKER = "benchmarks._scaling_worker"  # run with -m from the repository root, as the benchmarks are
MiB = 1 << 20
STAGES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def spawn(nproc: int, threads: int, jobs: list[dict], tmp: Path, label: str, timeout: float) -> dict:
    """Run ``jobs`` in one process group of ``nproc`` ranks (one plain process when 1); rank 0's results."""
    spec, out = tmp / f"{label}.spec.json", tmp / f"{label}.out.json"
    spec.write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"]}
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", WORKER, str(spec), str(out)]
    else:
        cmd = [sys.executable, "-m", WORKER, str(spec), str(out)]
    t0 = time.perf_counter()
    print(f"[{label}] {nproc} process(es) x {threads} thread(s): {', '.join(j['name'] for j in jobs)} ...", flush=True)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        failed = proc.returncode != 0
        tail = proc.stderr[-3000:]
    except subprocess.TimeoutExpired as e:
        failed, tail = True, f"timed out after {timeout:.0f} s\n{(e.stderr or b'')[-3000:]!r}"
    results = json.loads(out.read_text()) if out.exists() else {}
    print(f"[{label}] done in {time.perf_counter() - t0:.0f} s", flush=True)
    if failed:
        print(f"[{label}] the spawn failed; figures it did not write are left out:\n{tail}", file=sys.stderr)
    for name, r in results.items():
        if isinstance(r, dict) and "error" in r:
            print(f"[{label}] {name}: {r['error']}\n{r.get('trace', '')}", file=sys.stderr)
    return results


def timed(results: dict, names: list[str], skip: int) -> tuple[float | None, int]:
    """Median tokens/s over the steps after ``skip`` of each named run, and how many steps it covers."""
    rates = [v for n in names if "tokens_per_s" in results.get(n, {}) for v in results[n]["tokens_per_s"][skip:]]
    return (statistics.median(rates) if rates else None), len(rates)


def max_loss_diff(a: dict | None, b: dict | None) -> float | None:
    if not a or not b or "losses" not in a or "losses" not in b or len(a["losses"]) != len(b["losses"]):
        return None
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))


def parse_args() -> argparse.Namespace:
    """The arguments, with --steps, --rounds, --skip and --seq-len resolved (--quick changes their defaults)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=None, help="steps of each timed run (default 20; 5 with --quick)")
    ap.add_argument("--batch-size", type=int, default=16, help="global batch in sequences, split over the ranks")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len (64 with --quick)")
    ap.add_argument("--rounds", type=int, default=None, help="runs of each timed loop (default 2; 1 with --quick)")
    ap.add_argument("--skip", type=int, default=None, help="warm-up steps left out of the median (default 3; 2 with --quick)")
    ap.add_argument("--memory-ranks", type=int, nargs="+", default=[2, 4], help="world sizes of the memory measurement")
    ap.add_argument("--quick", action="store_true", help="a fast smoke run: few short steps, one round (figures meaningless)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds allowed to each spawn")
    args = ap.parse_args()
    args.steps = args.steps or (5 if args.quick else 20)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.skip = args.skip if args.skip is not None else (2 if args.quick else 3)
    args.seq_len = args.seq_len or (64 if args.quick else None)
    if args.skip >= args.steps:
        ap.error(f"--skip {args.skip} leaves no timed step of --steps {args.steps}")
    if args.batch_size % 2:
        ap.error(f"--batch-size {args.batch_size} must split over 2 ranks")
    return args


def run_all(args, base: TrainConfig) -> dict:
    """Every spawn: 2 ranks (the two DDP loops alternating, then memory at 2 ranks), one process at 1 and 2
    threads, memory at the other world sizes. Results by spawn, with the load average and the wall time."""
    rounds = args.rounds
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="prunus-scaling-") as d:
        tmp = Path(d)

        def job(kind: str, name: str, **changes) -> dict:
            return {"kind": kind, "name": name, "config": {**base.to_dict(), "out": str(tmp / name), **changes}}

        two = [j for r in range(rounds) for j in (job("raw", f"raw_ddp{r}"), job("prunus", f"prunus_ddp{r}", zero=0))]
        mem_cfg = dict(steps=1, seq_len=min(64, base.resolved_seq_len()))
        mem = {n: [job("memory", f"mem{n}_zero{z}", zero=z, batch_size=n, **mem_cfg) for z in STAGES]
               for n in args.memory_ranks}
        r2 = spawn(2, 1, two + mem.pop(2, []), tmp, "ddp-x2", args.timeout)
        r1t1 = spawn(1, 1, [job("prunus", f"prunus_1t{r}") for r in range(rounds)], tmp, "one-process-1-thread", args.timeout)
        r1t2 = spawn(1, 2, [job("prunus", f"prunus_2t{r}") for r in range(rounds)], tmp, "one-process-2-threads", args.timeout)
        r_mem = {2: r2}
        for n, jobs in mem.items():
            r_mem[n] = spawn(n, 1, jobs, tmp, f"memory-x{n}", args.timeout)
    return {"r2": r2, "r1t1": r1t1, "r1t2": r1t2, "mem": r_mem, "load": (load_before, os.getloadavg()),
            "wall": time.perf_counter() - t_start}


def throughput_section(args, base: TrainConfig, res: dict) -> None:
    """Tokens/s of each loop, the ratios against their goals, and the loss agreement that shows equal work."""
    rounds, skip, r2, r1t1, r1t2 = args.rounds, args.skip, res["r2"], res["r1t1"], res["r1t2"]
    names = lambda prefix: [f"{prefix}{r}" for r in range(rounds)]  # noqa: E731
    ddp, n_ddp = timed(r2, names("prunus_ddp"), skip)
    raw, n_raw = timed(r2, names("raw_ddp"), skip)
    one1, n_one1 = timed(r1t1, names("prunus_1t"), skip)
    one2, n_one2 = timed(r1t2, names("prunus_2t"), skip)

    def threads(r: dict) -> str:
        env = r.get("_env", {})
        return f"{env.get('torch_threads', '?')}" if env else "?"

    (load_before, load_after), mc = res["load"], base.model_config()
    print(f"\n{machine_line()}, {len(os.sched_getaffinity(0))} usable, "
          f"load average {load_before[0]:.2f} before / {load_after[0]:.2f} after (1 min), {res['wall']:.0f} s in all")
    print(f"model: {args.preset} ({mc.num_params():,} params), global batch {base.batch_size} x seq {base.resolved_seq_len()} "
          f"= {base.tokens_per_step:,} tokens/step, {args.steps} steps x {rounds} round(s), median of steps after {skip}")
    show("Throughput (same global batch, same batches)", ["run", "procs x threads", "tokens/s", "steps timed"], [
        ["prunus DDP (zero 0)", f"2 x {threads(r2)}", fmt(ddp), str(n_ddp)],
        ["raw torch DDP loop", f"2 x {threads(r2)}", fmt(raw), str(n_raw)],
        ["prunus, one process", f"1 x {threads(r1t1)}", fmt(one1), str(n_one1)],
        ["prunus, one process", f"1 x {threads(r1t2)}", fmt(one2), str(n_one2)],
    ])
    q_raw, q_1, q_2 = ratio(ddp, raw), ratio(ddp, one1), ratio(ddp, one2)
    show("Ratios", ["ratio", "value", "goal", "met"], [
        ["prunus DDP x2 / raw DDP x2", fmt(q_raw, ".3f"), ">= 0.95", goal(q_raw, lambda v: v >= 0.95)],
        ["prunus DDP x2 / prunus 1 process, 1 thread", fmt(q_1, ".3f"), ">= 1.4", goal(q_1, lambda v: v >= 1.4)],
        ["prunus DDP x2 / prunus 1 process, 2 threads", fmt(q_2, ".3f"), ">= 1.4", goal(q_2, lambda v: v >= 1.4)],
    ])
    checks = [(f"raw DDP round {r + 1}", r2.get(f"raw_ddp{r}")) for r in range(rounds)]
    checks += [(f"prunus 1 process x {t} thread(s), round {r + 1}", one.get(f"prunus_{t}t{r}"))
               for t, one in ((1, r1t1), (2, r1t2)) for r in range(rounds)]
    diffs = [(label, max_loss_diff(r2.get("prunus_ddp0"), other)) for label, other in checks]
    print("same computation (max |loss difference| per step against prunus DDP round 1): "
          + ", ".join(f"{label} {fmt(v, '.1e')}" for label, v in diffs))


def memory_row(n: int, z: int, res: dict) -> list[str]:
    """One row of the memory table: stage ``z`` at ``n`` ranks, against DDP's bytes and the ideal 1/n share."""
    ref = res.get(f"mem{n}_zero0", {}).get("per_rank")
    P, G, O = (max(r[k] for r in ref) for k in ("params", "grads", "opt_state")) if ref else (None, None, None)
    per_rank = res.get(f"mem{n}_zero{z}", {}).get("per_rank")
    if not per_rank:
        return [f"{STAGES[z]} x {n}"] + ["n/a"] * 9
    totals = [r["params"] + r["grads"] + r["opt_state"] for r in per_rank]
    worst = per_rank[totals.index(max(totals))]
    ideal = {0: P + G + O, 1: P + G + O / n, 2: P + (G + O) / n, 3: (P + G + O) / n}[z] if ref else None
    m_i = ratio(max(totals), ideal)
    return [f"{STAGES[z]} x {n}", f"{worst['params'] / MiB:.2f}", f"{worst['grads'] / MiB:.2f}",
            f"{worst['opt_state'] / MiB:.2f}", f"{max(totals) / MiB:.2f} ({min(totals) / MiB:.2f})",
            fmt(ratio(max(totals), P + G + O if ref else None), ".3f"), fmt(ideal and ideal / MiB, ".2f"),
            fmt(m_i, ".3f"), goal(m_i, lambda v: v <= 1.05), f"{max(r['gathered_fwd'] for r in per_rank) / MiB:.2f}"]


def memory_section(args, res: dict) -> None:
    rows = [memory_row(n, z, res["mem"].get(n, {})) for n in args.memory_ranks for z in STAGES]
    show("Model state per rank after one optimizer step, MiB (parameters + gradients + optimizer state of the rank "
         "holding most; the least in brackets)",
         ["stage x ranks", "params", "grads", "opt state", "total (min)", "/ DDP", "ideal", "measured / ideal",
          "<= 1.05", "+ gathered fwd-bwd"], rows)
    print("ideal: DDP's bytes with 1/N of what the stage shards (ZeRO-1: optimizer states; ZeRO-2: + gradients; "
          "ZeRO-3: + parameters).\n"
          "+ gathered fwd-bwd: full parameters FSDP holds from forward to backward on top of the shards (ZeRO-2: all; "
          "ZeRO-3: the last block, which prunus keeps gathered for backward). Between steps FSDP2 holds ZeRO-2's "
          "parameters sharded, like ZeRO-3's, so ZeRO-2 at rest measures below its ideal.\n"
          "Not counted: DDP's gradient buckets (about the gradients' bytes again, DDP and ZeRO-1), activations, "
          "FSDP's transient communication buffers.")


def main() -> None:
    args = parse_args()
    base = TrainConfig(preset=args.preset, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                       warmup_steps=5, eval_every=10**9, eval_tokens=4096, ckpt_every=0, progress=False,
                       max_corpus_bytes=4 << 20, timeout_s=600)
    base.validate()
    res = run_all(args, base)
    throughput_section(args, base, res)
    memory_section(args, res)


if __name__ == "__main__":
    sys.exit(main())
