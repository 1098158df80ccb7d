"""Fine-tuning throughput and memory on SmolLM2-135M: prunus full fine-tuning, LoRA and QLoRA (int8 base) beside
a minimal hand-written Hugging Face PEFT + torch loop, on the same token batches.

    python -m benchmarks.finetune [--steps 8] [--warmup 2] [--seq-len 256] [--batch-size 4] [--threads 2] \
        [--out runs/finetune_bench.json]

The instruction set is built offline (benchmarks/stdlib_docstrings.py) and packed into ``--seq-len`` rows by
prunus's own loader; the ``--warmup + --steps`` batches are drawn once (the run's seeded sampler) and saved, and
every configuration trains on exactly those batches, with the loss on the completion tokens only (targets
``IGNORE_INDEX`` left out), summed and divided by the batch's trained targets. Configurations:

* ``full``: prunus, every weight trained (``TrainConfig(init_from=BASE)``);
* ``lora``: prunus, rank 8 (alpha 16) adapters on all seven projections (wq, wk, wv, wo, w1, w2, w3);
* ``qlora``: prunus, the same adapters over an int8 weight-only copy of the base, made first with
  ``prunus.compress.compress`` (untimed);
* ``peer``: ``transformers.AutoModelForCausalLM`` on the Hugging Face dir + ``peft.LoraConfig(r=8, alpha 16,
  q/k/v/o/gate/up/down_proj)`` + ``torch.optim.AdamW`` with the same lr, betas, weight decay (matrices) and
  gradient clipping as prunus, in a hand-written loop (forward, loss, backward, clip, step, zero_grad).

Each configuration runs in a fresh subprocess (this script with ``--child``), so memory peaks do not mix, with
``torch.set_num_threads(--threads)`` and ``OMP_WAIT_POLICY=PASSIVE``. prunus is driven through its Python API:
``Trainer(cfg)`` builds the run (model from ``init_from``, adapters, optimizer), and each step is
``Trainer.train_step(step, batches)`` timed on its own (its evaluation and logging pushed past the timed steps),
so no run-minus-empty-run subtraction is needed. Figures: tokens/s over the timed steps (after ``--warmup``
untimed steps), counted as all positions (batch x seq len) and as trained (completion) targets; peak memory as
the child's ``VmHWM`` (peak resident set) minus its ``VmRSS`` after imports, before the model is loaded (the
model, optimizer state, activations and everything else the run holds), and the absolute ``VmHWM``. Each
configuration's first and last training loss are shown too, a check that every loop trains; the peer's first
loss is lower than prunus's on the same batch because it attends across the packed documents (earlier rows give
it context) where prunus restarts positions and attention at each document.

Differences in the work done: prunus masks attention inside each packed document (its ``doc_ids``); the
hand-written loop feeds the packed row as one causal sequence, as a minimal loop does. The script prints a table
with the LoRA / hand-written ratios (goal: throughput >= 1.0x, memory <= 1.0x) and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import fmt, goal, ratio, show

CONFIGS = ("full", "lora", "qlora", "peer")
PRUNUS_TARGETS = "wq,wk,wv,wo,w1,w2,w3"
PEER_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def proc_status_kib(field: str) -> int:
    """A ``/proc/self/status`` field (VmRSS, VmHWM) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def train_config(args, kind: str, base: str, run_out: str):
    """The prunus TrainConfig of ``kind`` (full / lora / qlora); eval, logging and the schedule's end lie past
    the steps this benchmark runs, so no step evaluates or saves."""
    from prunus.train_parallel import TrainConfig

    total = args.warmup + args.steps
    lora = {} if kind == "full" else {"lora_rank": args.rank, "lora_alpha": 2.0 * args.rank,
                                      "lora_targets": PRUNUS_TARGETS}
    return TrainConfig(out=run_out, init_from=base, data=args.data, seq_len=args.seq_len, batch_size=args.batch_size,
                       steps=total + 1, lr=args.lr, min_lr=args.lr, warmup_steps=0, eval_every=10 ** 9,
                       log_every=10 ** 9, eval_tokens=args.seq_len, ckpt_every=0, progress=False, seed=args.seed,
                       **lora)


def prunus_steps(args, kind: str, batches: list) -> tuple[list[float], list[float]]:
    """(seconds, training loss) of each step of a prunus run of ``kind`` on ``batches`` (one micro-batch a step)."""
    from prunus.train_parallel.trainer import Trainer

    base = args.int8_base if kind == "qlora" else args.base
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(train_config(args, kind, base, str(Path(tmp) / "run")), overwrite=True)
        times, losses = [], []
        for step, batch in enumerate(batches):
            t0 = time.perf_counter()
            losses.append(trainer.train_step(step, [batch])["loss"])
            times.append(time.perf_counter() - t0)
    return times, losses


def peer_steps(args, batches: list) -> tuple[list[float], list[float]]:
    """(seconds, training loss) of each step of the hand-written transformers + peft loop on ``batches``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.hf_base, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                             target_modules=PEER_TARGETS)).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    times, losses = [], []
    for batch in batches:
        t0 = time.perf_counter()
        logits = model(input_ids=batch.inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch.targets.flatten(),
                                                 ignore_index=-100, reduction="sum") / max(batch.n_trained, 1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return times, losses


def child(args) -> None:
    """One configuration in this (fresh) process; prints its figures as one JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    if args.child == "peer":
        import peft  # noqa: F401  (imports before the baseline, as prunus's below)
        import transformers  # noqa: F401
    else:
        import prunus.train_parallel.trainer  # noqa: F401
    from prunus.data.packing import PackedBatch

    batches = [PackedBatch(*fields) for fields in torch.load(args.batches)]  # saved as plain tuples (weights_only)
    rss0 = proc_status_kib("VmRSS")
    times, losses = peer_steps(args, batches) if args.child == "peer" else prunus_steps(args, args.child, batches)
    hwm = proc_status_kib("VmHWM")
    print("RESULT " + json.dumps({"step_s": times, "losses": losses, "peak_rss_delta_mib": (hwm - rss0) / 1024,
                                  "peak_rss_mib": hwm / 1024, "rss_before_mib": rss0 / 1024}), flush=True)


def prepare(args, work: Path) -> list:
    """The instruction set, the int8 base (prunus.compress) and the batches every configuration trains on."""
    import torch
    from benchmarks.stdlib_docstrings import build

    from prunus.compress import compress
    from prunus.data.packing import get_packed_batch
    from prunus.train_parallel.checkpoint.init_from import run_tokenizer
    from prunus.train_parallel.trainer import load_train_data

    build(work / "data")
    args.data = str(work / "data" / "train.jsonl")
    if "qlora" in args.configs:
        args.int8_base = str(work / "int8")
        t0 = time.perf_counter()
        compress(args.base, [("quantize", {"scheme": "int8-weight-only"})], args.int8_base, latency=False,
                 progress=False, eval_tokens=args.seq_len, seq_len=args.seq_len)
        print(f"int8 weight-only base: {args.int8_base} ({time.perf_counter() - t0:.0f} s, untimed)", flush=True)
    cfg = train_config(args, "lora", args.base, str(work / "unused"))
    vocab = cfg.model_config().vocab_size
    rows = load_train_data(cfg, run_tokenizer(cfg, vocab), vocab).train
    batches = [get_packed_batch(rows, seed=args.seed, step=s, micro_batch=args.batch_size)
               for s in range(args.warmup + args.steps)]
    args.batches = str(work / "batches.pt")
    torch.save([dataclasses.astuple(b) for b in batches], args.batches)
    return batches


def run_child(args, kind: str) -> dict:
    """Run configuration ``kind`` in a fresh subprocess; its figures."""
    cmd = [sys.executable, __file__, "--child", kind]
    for name in ("base", "hf_base", "int8_base", "data", "batches", "steps", "warmup", "seq_len", "batch_size",
                 "threads", "rank", "lr", "seed"):
        value = getattr(args, name)
        if value is not None:
            cmd += [f"--{name.replace('_', '-')}", str(value)]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"configuration {kind} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summarize(result: dict, args, batches: list) -> dict:
    """Tokens/s over the timed steps (all positions and trained targets) from the child's step times."""
    timed = result["step_s"][args.warmup:]
    seconds = sum(timed)
    positions = args.steps * args.batch_size * args.seq_len
    trained = sum(b.n_trained for b in batches[args.warmup:])
    return {**result, "timed_s": seconds, "tokens_per_s": positions / seconds, "trained_tokens_per_s": trained / seconds}


def report(results: dict, args) -> dict:
    rows = []
    peer = results.get("peer")
    for kind, r in results.items():
        rows.append([kind, fmt(r["tokens_per_s"], ",.1f"), fmt(r["trained_tokens_per_s"], ",.1f"),
                     fmt(r["peak_rss_delta_mib"], ",.0f"), fmt(r["peak_rss_mib"], ",.0f"),
                     fmt(ratio(r["tokens_per_s"], peer and peer["tokens_per_s"]), ".2f"),
                     fmt(ratio(r["peak_rss_delta_mib"], peer and peer["peak_rss_delta_mib"]), ".2f"),
                     f"{r['losses'][0]:.3f} / {r['losses'][-1]:.3f}"])
    show(f"fine-tuning SmolLM2-135M: seq {args.seq_len}, batch {args.batch_size}, {args.steps} timed steps after "
         f"{args.warmup}, {args.threads} threads",
         ["config", "tokens/s", "trained tokens/s", "peak RSS delta MiB", "peak RSS MiB", "tok/s vs peer",
          "mem vs peer", "first / last loss"], rows)
    lora = results.get("lora")
    speed = ratio(lora and lora["tokens_per_s"], peer and peer["tokens_per_s"])
    memory = ratio(lora and lora["peak_rss_delta_mib"], peer and peer["peak_rss_delta_mib"])
    show("LoRA vs the hand-written PEFT loop", ["figure", "ratio", "goal", "met"],
         [["throughput (prunus / peer)", fmt(speed, ".3f"), ">= 1.0", goal(speed, lambda v: v >= 1.0)],
          ["peak memory (prunus / peer)", fmt(memory, ".3f"), "<= 1.0", goal(memory, lambda v: v <= 1.0)]])
    return {"lora_vs_peer_throughput": speed, "lora_vs_peer_memory": memory}


def versions() -> dict:
    """torch, transformers and peft versions (the peer's stack), for the JSON report."""
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "peft")}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="/work/real/smollm2", help="prunus model dir of SmolLM2-135M (read only)")
    ap.add_argument("--hf-base", default="/work/real/smollm2-hf", help="the same model as a Hugging Face dir")
    ap.add_argument("--out", default="runs/finetune_bench.json", help="the JSON report")
    ap.add_argument("--steps", type=int, default=8, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every configuration")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    # set by the parent for its children
    ap.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    ap.add_argument("--int8-base", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--batches", help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown or args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"--configs {sorted(unknown)} unknown (choose from {CONFIGS}) or --steps < 1 / --warmup < 0")
    with tempfile.TemporaryDirectory(prefix="prunus-finetune-bench-") as tmp:
        batches = prepare(args, Path(tmp))
        results = {}
        for kind in args.configs:
            t0 = time.perf_counter()
            results[kind] = summarize(run_child(args, kind), args, batches)
            print(f"{kind}: {results[kind]['tokens_per_s']:.1f} tokens/s, peak RSS delta "
                  f"{results[kind]['peak_rss_delta_mib']:.0f} MiB ({time.perf_counter() - t0:.0f} s)", flush=True)
    ratios = report(results, args)
    settings = {k: getattr(args, k) for k in ("base", "hf_base", "steps", "warmup", "seq_len", "batch_size", "threads",
                                               "rank", "lr", "seed")}
    settings.update(lora_alpha=2.0 * args.rank, prunus_targets=PRUNUS_TARGETS, peer_targets=PEER_TARGETS,
                    trained_tokens_timed=sum(b.n_trained for b in batches[args.warmup:]), torch_threads=args.threads,
                    omp_wait_policy="PASSIVE", versions=versions())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": settings, "results": results, **ratios}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
