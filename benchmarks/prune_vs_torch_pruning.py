"""Structured pruning + fine-tune: prunus's ``prune_channels`` pass beside torch-pruning used directly, on the same
trained weights and at the same parameter count, for four model kinds (:mod:`benchmarks._prune_models`): a ViT-like
classifier on ``load_digits``, a token ``nn.TransformerEncoder`` on a synthetic sequence task, a 1-D CNN regressing
a property of synthetic signals, and an MLP regressor on ``load_diabetes``.

1. **train**: each module with prunus's generic trainer (AdamW, cosine lr), one model dir per kind.
2. **prunus**: ``prunus.compress.compress`` (the Python API under ``prunus compress``) with ``prune_channels`` at
   ``--amount`` of the channels and ``--finetune-steps`` of fine-tuning (AdamW, batch 64, ``--lr``).
3. **torch-pruning** used as its own examples do: ``MetaPruner`` with ``GroupMagnitudeImportance(p=2)``, one
   pruning ratio for every layer (found by bisection so the parameter count equals prunus's), the output layer
   ignored, attention widths rounded to the heads (``round_to``); then a plain AdamW loop of the same steps,
   batch and lr.

Prints, per model: params before / after, the held-out metric (accuracy: higher is better; MSE: lower is
better) of the trained model, of prunus and of torch-pruning, and the ratio prunus / torch-pruning (for MSE the
peer's / prunus's, so above 1 means prunus is better in both).

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.prune_vs_torch_pruning [--amount 0.5] [--finetune-steps 150]
        [--only vit-digits,...] [--seeds 1] [--json F]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import torch
from torch import nn

from benchmarks._prune_models import KINDS, metric, stacked, train
from benchmarks.harness import machine_line, overlap, show, write_results

BATCH = 64


def prune_prunus(model_dir: Path, data: str, out: Path, args, seed: int) -> dict:
    """prunus's pass through its Python API (what ``prunus compress --recipe`` runs)."""
    from prunus.compress import compress

    args = {"amount": args.amount, "finetune_steps": args.finetune_steps, "lr": args.lr, "batch_size": BATCH,
            **({"importance": args.importance} if args.importance else {})}
    report = compress(model_dir, [("prune_channels", args)], out, data=data, trust_factory=True,
                      latency=False, seed=seed)
    row = report["rows"][-1]
    return {"metric": row.get("val_accuracy", row["val_loss"]), "params": row["params"]}


def _peer_cut(model: nn.Module, example: torch.Tensor, ratio: float) -> nn.Module:
    """torch-pruning's MetaPruner as its examples use it: group L2 magnitude, one ratio for every layer, the
    output layer ignored, attention widths rounded to the heads."""
    import math

    import torch_pruning as tp

    from prunus.compress.module_prune import output_layers

    heads = [m.num_heads for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
    pruner = tp.pruner.MetaPruner(model, example, importance=tp.importance.GroupMagnitudeImportance(p=2),
                                  pruning_ratio=ratio, ignored_layers=output_layers(model, example),
                                  round_to=math.lcm(*heads) if heads else None)
    pruner.step()
    return model


def peer_at_params(dense: nn.Module, example: torch.Tensor, target: int) -> nn.Module:
    """torch-pruning's cut whose parameter count is closest to ``target`` (bisection over its one ratio)."""
    lo, hi, best = 0.0, 0.95, None
    for _ in range(14):
        mid = (lo + hi) / 2
        cut = _peer_cut(copy.deepcopy(dense), example, mid)
        n = sum(p.numel() for p in cut.parameters())
        if best is None or abs(n - target) < abs(best[0] - target):
            best = (n, cut)
        if n == target:
            break
        lo, hi = (mid, hi) if n > target else (lo, mid)
    return best[1]


def finetune_plain(model: nn.Module, train_xy, task: str, steps: int, lr: float, seed: int) -> nn.Module:
    """A plain AdamW loop (constant lr) of ``steps`` random batches."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(train_xy[0]), (BATCH,), generator=gen)
        out, y = model(train_xy[0][idx]), train_xy[1][idx]
        loss = (nn.functional.cross_entropy(out, y) if task == "classification"
                else nn.functional.mse_loss(out, y.reshape(out.shape)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def run_kind(kind, root: Path, args, seed: int) -> dict:
    """Train ``kind``, prune it both ways; its row of figures."""
    from prunus.data.module_datasets import module_datasets
    from prunus.models.model_dir import load_model

    data = kind.data(root)
    tr, val = module_datasets(data, task=kind.task)
    train_xy, val_xy = stacked(tr), stacked(val)
    model_dir = train(kind, data, root / f"{kind.name}-{seed}", seed)
    dense = load_model(model_dir, trust_factory=True).eval()
    ours = prune_prunus(model_dir, data, root / f"{kind.name}-{seed}-pruned", args, seed)
    peer = peer_at_params(dense, train_xy[0][:2], ours["params"])
    peer_params = sum(p.numel() for p in peer.parameters())
    peer = finetune_plain(peer, train_xy, kind.task, args.finetune_steps, args.lr, seed)
    return {"params_before": sum(p.numel() for p in dense.parameters()), "params_prunus": ours["params"],
            "params_peer": peer_params, "dense": metric(dense, *val_xy, kind.task), "prunus": ours["metric"],
            "torch-pruning": metric(peer, *val_xy, kind.task), "metric": kind.metric}


def better_ratio(r: dict) -> float:
    """prunus / torch-pruning for accuracy, torch-pruning / prunus for MSE: above 1, prunus is better."""
    return r["prunus"] / r["torch-pruning"] if r["metric"] == "accuracy" else r["torch-pruning"] / r["prunus"]


def report(results: dict) -> None:
    rows = []
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("dense", "prunus", "torch-pruning")}
        ratios = [better_ratio(r) for r in runs]
        noise = "≈ " if overlap([r["prunus"] for r in runs], [r["torch-pruning"] for r in runs]) else ""
        r0 = runs[0]
        rows.append([name, runs[0]["metric"], f"{r0['params_before']:,}", f"{r0['params_prunus']:,}",
                     f"{r0['params_peer']:,}", f"{med['dense']:.4f}", f"{med['prunus']:.4f}",
                     f"{med['torch-pruning']:.4f}", noise + " ".join(f"{x:.3f}" for x in ratios)])
    show("prune + fine-tune at the same parameter count (held-out; median over seeds)",
         ["model", "metric", "params", "prunus params", "peer params", "trained", "prunus", "torch-pruning",
          "ratio per seed (>1: prunus better)"], rows, width=160)
    print("≈: prunus's and torch-pruning's ranges over the seeds overlap (a difference within noise)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--amount", type=float, default=0.5, help="share of channels prunus cuts")
    parser.add_argument("--finetune-steps", type=int, default=150, help="fine-tune steps after pruning (batch 64)")
    parser.add_argument("--importance", default=None, help="prunus's importance (default: the pass's own, taylor)")
    parser.add_argument("--lr", type=float, default=3e-3, help="fine-tune learning rate (both)")
    parser.add_argument("--seeds", type=int, default=1, help="repeat with seeds 0..N-1 (training and fine-tune)")
    parser.add_argument("--only", default=None, help="comma-separated model names")
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    kinds = [k for k in KINDS if args.only is None or k.name in args.only.split(",")]
    print(machine_line())
    t0, results = time.perf_counter(), {}
    with tempfile.TemporaryDirectory(prefix="prunus-prune-bench-") as tmp:
        for kind in kinds:
            results[kind.name] = [run_kind(kind, Path(tmp), args, seed) for seed in range(args.seeds)]
            print(f"{kind.name}: {results[kind.name]}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    report(results)
    if args.json:
        write_results(args.json, vars(args), results)


if __name__ == "__main__":
    main()
