"""ResNet-50 (the standard architecture, :func:`benchmarks.resnet50_cpu.resnet50`) and the two-Linear toy model
trained by ``prunus train --model`` under DDP x 2, FSDP x 2 and (ResNet-50) a pipeline of 2 stages split at
``layer3`` (``seq1 = conv1 ... layer2``, ``seq2 = layer3 ... fc``): each run's per-step losses beside one process's.

Data: prunus's seeded synthetic classification set (3 x 32 x 32 images, 10 classes; 64-wide vectors for the toy).
References: one process with the same global batch for DDP and FSDP (BatchNorm synchronised across the ranks with
``--sync-batchnorm``, so both normalise over the whole batch); one process accumulating the pipeline's micro-batches
(``--grad-accum``) for the pipeline (BatchNorm's statistics are per micro-batch in both). Every run goes through the
command line, in processes of its own (gloo, one thread each). Prints each run's largest |loss - reference| over
the steps and the validation loss, against the tolerance; exits 1 if one is above it.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.resnet50_layouts [--steps 3] [--batch 8] [--tol 1e-4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import machine_line, show

ROOT = Path(__file__).resolve().parents[1]
RESNET = ("benchmarks.resnet50_cpu:resnet50", "classes=10", "synthetic:classification?n=256&shape=3x32x32&classes=10")
TOY = ("benchmarks.ddp_vs_handwritten:two_linear", None, "synthetic:classification?n=256&shape=64&classes=10")
LAYOUTS = {  # name: (model, flags, reference flags)
    "toy, DDP x 2": (TOY, ["--nproc", "2", "--zero", "0"], []),
    "toy, FSDP x 2": (TOY, ["--nproc", "2", "--zero", "3"], []),
    "ResNet-50, DDP x 2, sync BN": (RESNET, ["--nproc", "2", "--zero", "0", "--sync-batchnorm"], []),
    "ResNet-50, FSDP x 2, sync BN": (RESNET, ["--nproc", "2", "--zero", "3", "--sync-batchnorm"], []),
    "ResNet-50, PP x 2 at layer3, 1F1B, 4 micro-batches": (
        RESNET, ["--nproc", "2", "--pp-split", "layer3", "--pp-schedule", "1F1B", "--microbatches", "4"],
        ["--grad-accum", "4"]),
}


def train(model: tuple, flags: list[str], out: Path, args) -> dict:
    """One ``prunus train --model`` run; its per-step losses and last validation loss from metrics.jsonl."""
    spec, model_args, data = model
    cmd = [sys.executable, "-m", "prunus.cli.main", "train", "--model", spec, *(["--model-args", model_args]
           if model_args else []), "--data", data, "--task", "classification", "--steps", str(args.steps),
           "--batch-size", str(args.batch), "--log-every", "1", "--eval-every", str(args.steps), "--seed", "0",
           "--out", str(out), *(["--lr", str(args.lr)] if args.lr else []), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    t0 = time.perf_counter()
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {run.returncode}\n{run.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in records if "loss" in r and "step" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return {"losses": losses, "val_loss": val[-1] if val else None, "s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--tol", type=float, default=1e-4, help="largest |loss - one process| accepted")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: prunus's)")
    p.add_argument("--only", default=None, help="run the layouts whose name holds this")
    args = p.parse_args(argv)
    print(machine_line())
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory(prefix="prunus-layouts-") as tmp:
        refs: dict[tuple, dict] = {}
        for i, (name, (model, flags, ref_flags)) in enumerate(LAYOUTS.items()):
            if args.only and args.only not in name:
                continue
            key = (model, tuple(ref_flags))
            if key not in refs:
                refs[key] = train(model, ref_flags, Path(tmp) / f"ref{len(refs)}", args)
            ref, got = refs[key], train(model, flags, Path(tmp) / f"run{i}", args)
            if len(got["losses"]) != len(ref["losses"]) or got["val_loss"] is None:
                raise SystemExit(f"{name}: {len(got['losses'])} losses against {len(ref['losses'])}")
            diff = max([abs(a - b) for a, b in zip(got["losses"], ref["losses"])]
                       + [abs(got["val_loss"] - ref["val_loss"])])
            worst = max(worst, diff)
            rows.append([name, " ".join(f"{v:.5f}" for v in got["losses"]), " ".join(f"{v:.5f}" for v in ref["losses"]),
                         f"{diff:.2e}", "ok" if diff <= args.tol else "ABOVE", f"{got['s']:.0f} / {ref['s']:.0f}"])
            print(f"  {name}: max |Δ loss| {diff:.2e}", flush=True)
    print(f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    show(f"per-step losses, {args.steps} steps of global batch {args.batch}, against one process (tolerance "
         f"{args.tol:g})", ["layout", "losses", "one process", "max |Δ| (steps, val)", "", "s run / ref"], rows,
         width=170)
    if worst > args.tol:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
