"""Worked example: LoRA fine-tuning of SmolLM2-135M on stdlib docstrings, on a CPU, in minutes.

    python -m benchmarks.finetune_smollm2 [--base /work/real/smollm2] [--out runs/finetune_smollm2] [--steps 60]

1. builds the instruction set offline (benchmarks/stdlib_docstrings.py: a function's signature as the prompt,
   its docstring's first paragraph as the completion; held-out split by module);
2. scores the base model on the held-out modules: mean negative log-likelihood of the completion tokens
   given their prompt, and greedy completions of three held-out prompts;
3. trains LoRA adapters (rank 8 on every projection by default) with ``prunus.train_parallel.train`` from
   the base model dir (``init_from``); the run dir gets metrics.jsonl, loss.png, the merged model dir ``model/``
   and the adapter in PEFT's format ``adapter/``;
4. scores the merged model dir the same way and writes ``OUT/finetune.json``.

The run is ``prunus train --init-from BASE --data train.jsonl --lora-rank 8 ... --save-adapter`` (the
script prints the command line): instruction rows packed into --seq-len rows, the loss on the completion
tokens only. ``--plain-text`` trains on ``train.txt`` instead (prompt and completion as raw text, every
token trained). The base dir is only read.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.stdlib_docstrings import build

from prunus.models import load_model
from prunus.models.generate import generate
from prunus.models.model_dir import load_model_tokenizer
from prunus.train_parallel import TrainConfig, train

SAMPLES = 3  # held-out prompts generated before and after


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@torch.no_grad()
def heldout_loss(model, tokenizer, rows: list[dict]) -> float:
    """Mean NLL (nats per token) of the completion tokens given their prompt, over every held-out row."""
    total, count = 0.0, 0
    for row in rows:
        prompt, full = tokenizer.encode(row["prompt"]), tokenizer.encode(row["prompt"] + row["completion"])
        ids = torch.tensor(full).unsqueeze(0)
        logits = model(ids[:, :-1]).float()
        nll = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:], reduction="none")
        total += float(nll[len(prompt) - 1:].sum())
        count += len(full) - len(prompt)
    return total / count


@torch.no_grad()
def completions(model, tokenizer, rows: list[dict], max_new_tokens: int = 40) -> list[str]:
    out = []
    for row in rows:
        prompt = torch.tensor(tokenizer.encode(row["prompt"]))
        ids = generate(model, prompt, max_new_tokens, eos_id=tokenizer.stop_ids)
        out.append(tokenizer.decode(ids[0, len(prompt):].tolist()))
    return out


def score(model_dir: Path, tokenizer, rows, samples) -> dict:
    model = load_model(model_dir)
    return {"heldout_loss": heldout_loss(model, tokenizer, rows), "samples": completions(model, tokenizer, samples)}


@torch.no_grad()
def peft_parity(hf_base: Path, adapter: Path, merged_dir: Path, tokenizer, text: str) -> dict | None:
    """Max |logit difference| on ``text`` between the merged prunus model dir and Hugging Face PEFT (the adapter
    loaded onto the base's Hugging Face checkpoint), unmerged and after PEFT's own ``merge_and_unload``; None when
    peft / transformers or the checkpoint are missing."""
    try:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    if not (hf_base / "config.json").is_file():
        return None
    ids = torch.tensor(tokenizer.encode(text)).unsqueeze(0)
    ours = load_model(merged_dir)(ids)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32), adapter).eval()
    unmerged = peft(ids).logits
    merged = peft.merge_and_unload()(ids).logits
    return {"vs_peft": float((ours - unmerged).abs().max()), "vs_peft_merged": float((ours - merged).abs().max()),
            "peft_merged_vs_unmerged": float((merged - unmerged).abs().max()), "logit_scale": float(ours.abs().max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="/work/real/smollm2", help="prunus model dir of SmolLM2-135M (read only)")
    ap.add_argument("--hf-base", default="/work/real/smollm2-hf", help="the base as a Hugging Face dir (PEFT parity check)")
    ap.add_argument("--out", default="runs/finetune_smollm2")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="wq,wk,wv,wo,w1,w2,w3")
    ap.add_argument("--heldout-rows", type=int, default=60, help="held-out rows scored (every module represented)")
    ap.add_argument("--plain-text", action="store_true", help="train on train.txt even when JSONL is supported")
    args = ap.parse_args()
    out, base = Path(args.out), Path(args.base)
    counts = build(out / "data")
    heldout = read_rows(out / "data" / "heldout.jsonl")
    heldout = heldout[:: max(1, len(heldout) // args.heldout_rows)][: args.heldout_rows]
    samples = [heldout[i * len(heldout) // SAMPLES] for i in range(SAMPLES)]
    tokenizer = load_model_tokenizer(base)
    t0 = time.perf_counter()
    before = score(base, tokenizer, heldout, samples)
    print(f"base: held-out completion loss {before['heldout_loss']:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)

    jsonl = not args.plain_text
    data = out / "data" / ("train.jsonl" if jsonl else "train.txt")
    cfg = TrainConfig(out=str(out / "run"), init_from=str(base), data=str(data), seq_len=args.seq_len,
                      batch_size=args.batch_size, steps=args.steps, lr=args.lr, min_lr=args.lr / 10,
                      warmup_steps=max(1, args.steps // 10), eval_every=max(1, args.steps // 6),
                      eval_tokens=16 * args.seq_len, ckpt_every=0, log_every=5, lora_rank=args.rank,
                      lora_alpha=2.0 * args.rank, lora_targets=args.targets, save_adapter=True)
    print("the same run from the command line:\n  prunus train " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in cfg.to_dict().items()
        if k in ("out", "init_from", "data", "seq_len", "batch_size", "steps", "lr", "min_lr", "warmup_steps",
                 "eval_every", "eval_tokens", "lora_rank", "lora_alpha", "lora_targets")) + " --save-adapter", flush=True)
    t1 = time.perf_counter()
    result = train(cfg, overwrite=True)
    train_s = time.perf_counter() - t1
    after = score(result.model_dir, tokenizer, heldout, samples)
    print(f"LoRA: held-out completion loss {after['heldout_loss']:.4f}", flush=True)
    parity = peft_parity(Path(args.hf_base), out / "run" / "adapter", result.model_dir, tokenizer,
                         samples[0]["prompt"] + samples[0]["completion"])
    report = {
        "peft_max_abs_logit_diff": parity,  # prunus merged vs PEFT
        "base": str(base), "data": str(data), "rows": counts, "heldout_rows_scored": len(heldout),
        "training_data": "jsonl (completion tokens trained)" if jsonl else "plain text (every token trained)",
        "settings": {"steps": args.steps, "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr,
                     "lora_rank": args.rank, "lora_alpha": 2.0 * args.rank, "lora_targets": args.targets},
        "train_seconds": train_s, "first_loss": result.losses[0], "last_loss": result.losses[-1],
        "heldout_loss_before": before["heldout_loss"], "heldout_loss_after": after["heldout_loss"],
        "samples": [{"prompt": s["prompt"], "reference": s["completion"], "before": b, "after": a}
                    for s, b, a in zip(samples, before["samples"], after["samples"])],
        "loss_plot": str(out / "run" / "loss.png"), "model_dir": str(result.model_dir), "adapter": str(out / "run" / "adapter"),
    }
    (out / "finetune.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))
    for s in report["samples"]:
        print(f"\n--- {s['prompt']}\n[before] {s['before']!r}\n[after]  {s['after']!r}\n[ref]    {s['reference']!r}")


if __name__ == "__main__":
    main()
