"""Distillation quality: a student of at most half the teacher's parameters, distilled, beside the
same architecture trained from scratch on the same token budget, in one run.

Both students train on the parallel engine with the same steps, global batch, learning-rate
schedule and data order; the distilled one starts from the teacher's blocks 0 and 2 narrowed
to 0.91x width (``keep-every:2,width:1.1``, 45% of the parameters) and learns
0.9 KD (T=2) + 0.1 cross-entropy, the scratch one starts from a fresh initialisation and learns
cross-entropy alone. Targets: the distilled student keeps >= 95% of the teacher's quality
(teacher bits per byte / student bits per byte >= 0.95) and beats the scratch student.
Plots both training curves and bits per byte against parameters to ``distill_quality.png``.

A section of ``compress_quality.py`` (``--only distill``), or on its own:

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m benchmarks.compress_quality_distill [--model runs/demo/model]
"""

from __future__ import annotations

import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import torch

from prunus.compress.distill import distill
from prunus.compress.student import make_student
from prunus.models import Transformer

STUDENT = "keep-every:2,width:1.1"
STEPS, BATCH, LR = 150, 8, 2e-3  # the token budget: 150 x 8 x 256 = 307,200 tokens
PLOT = Path(__file__).resolve().parent.parent / "runs" / "bench" / "distill_quality.png"


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def plot(curves: dict, points: dict, path: Path) -> None:
    """Training curves of the students, and bits per byte against parameters (labels placed clear of each other)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from prunus.train_parallel.plot import place_point_labels, plain_ticks, span_limits

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    for name, losses in curves.items():
        a.plot(range(1, len(losses) + 1), losses, label=name)
    a.set(xlabel="step", ylabel="training loss (its own objective)")
    a.set_title("students, same token budget", fontsize=10)
    a.legend(loc="upper right")
    xs, ys = [p / 1e6 for p, _ in points.values()], [bpb for _, bpb in points.values()]
    b.plot(xs, ys, "o", color="tab:blue")
    b.set_xlim(*span_limits(xs, min_span=0.2 * max(xs), pad=0.3))
    b.set_ylim(*span_limits(ys, min_span=0.01 * min(ys), pad=0.3))
    b.set(xlabel="parameters (M)", ylabel="validation bits per byte")
    b.set_title("quality against size", fontsize=10)
    for ax in (a, b):
        plain_ticks(ax)
    place_point_labels(fig, b, xs, ys, list(points))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def section_distill(bench) -> None:
    ctx, console = bench.ctx, bench_console()
    teacher = ctx.teacher
    student = make_student(teacher, STUDENT)
    torch.manual_seed(0)
    scratch = Transformer(student.config)
    scratch.init_weights()
    tokens = STEPS * BATCH * min(ctx.seq_len, student.config.max_seq_len)
    console.print(f"distillation: student {STUDENT} ({n_params(student):,} parameters, "
                  f"{n_params(student) / n_params(teacher):.3f}x the teacher's {n_params(teacher):,}); "
                  f"budget {STEPS} steps x {BATCH} sequences = {tokens:,} tokens, lr {LR}")
    runs, seconds = {}, {}
    for name, model, kw in (("distilled", student, dict(kd_weight=0.9, temperature=2.0)),
                            ("scratch", scratch, dict(kd_weight=0.0))):
        t0 = time.perf_counter()
        runs[name] = distill(model, ctx, steps=STEPS, batch_size=BATCH, lr=LR, **kw)
        seconds[name] = time.perf_counter() - t0
    rows = [bench.row(f"{name} {STUDENT}", runs[name].model) for name in runs]
    limit = 1 / 0.95 - 1  # teacher bpb / student bpb >= 0.95
    bench.table("distillation: a student of <= half the parameters, distilled vs trained from scratch on the same budget "
                "(target: >= 95% of the teacher's quality, and better than scratch)", rows,
                target=(f"distilled {STUDENT}", limit))
    base, (dist_row, scratch_row) = bench.base["val_bpb"], rows
    console.print(f"  quality kept (teacher bpb / student bpb): distilled {base / dist_row['val_bpb']:.4f}, "
                  f"scratch {base / scratch_row['val_bpb']:.4f}; distilled / scratch bits per byte "
                  f"{dist_row['val_bpb'] / scratch_row['val_bpb']:.4f} "
                  f"({'beats' if dist_row['val_bpb'] < scratch_row['val_bpb'] else 'does NOT beat'} scratch); "
                  f"train time {seconds['distilled']:.0f} s vs {seconds['scratch']:.0f} s "
                  f"({seconds['distilled'] / seconds['scratch']:.2f}x: the teacher's forward pass)")
    plot({name: r.losses for name, r in runs.items()},
         {"teacher": (n_params(teacher), base), "distilled": (n_params(student), dist_row["val_bpb"]),
          "scratch": (n_params(scratch), scratch_row["val_bpb"])}, PLOT)
    console.print(f"  plot: {PLOT}\n")


def bench_console():
    from rich.console import Console

    return Console(width=150)


def main() -> None:
    import argparse

    from benchmarks.compress_quality import ROOT, Bench, ensure_demo_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "runs" / "demo" / "model")
    parser.add_argument("--eval-tokens", type=int, default=262144, help="held-out tokens scored per variant")
    args = parser.parse_args()
    ensure_demo_model(args.model)
    bench = Bench(args.model, args.eval_tokens)
    bench_console().print(f"teacher {args.model}: {bench.base['params']:,} parameters, {bench.base['val_bpb']:.4f} bits per byte "
                          f"on {args.eval_tokens:,} held-out tokens\n")
    section_distill(bench)


if __name__ == "__main__":
    main()
