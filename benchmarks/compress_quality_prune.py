"""Pruning quality: bits per byte of prunus's pruning passes beside the dense model and torchao's Wanda.

On one model dir (default: the demo model, runs/demo/model), every row starts
from the same dense weights, prunes with the same calibration batches and is
scored on the same held-out tokens:

* dense; magnitude and Wanda at 50% unstructured (per layer, and Wanda global);
* torchao's ``WandaSparsifier`` at 50% (the peer: Wanda ranked across each whole
  layer rather than per output row);
* 2:4 with Wanda scores and with magnitude;
* structured: 25% of the heads, 25% of the MLP channels, one block.

Prints bits per byte, its ratio to dense (goal for Wanda 50%: <= 1.15) and to
torchao's Wanda, and plots quality against parameter count.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.compress_quality_prune [--model runs/demo/model]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import torch
from torch import nn

from prunus.compress.context import build_context
from prunus.compress.prune import prunable_linears, prune_pass, sparsity_of
from prunus.compress.prune_structured import prune_structured_pass
from prunus.models import load_model

N_CALIB = 8


def torchao_wanda(model: nn.Module, ctx, sparsity: float = 0.5) -> nn.Module:
    """The peer: torchao.sparsity.WandaSparsifier on the same Linears and calibration batches."""
    from torchao.sparsity.wanda import WandaSparsifier

    names = list(prunable_linears(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sparsifier = WandaSparsifier(sparsity_level=sparsity)
        sparsifier.prepare(model, [{"tensor_fqn": n + ".weight"} for n in names])
        with torch.no_grad():
            for tokens in ctx.calibration(N_CALIB):
                model(tokens)
        sparsifier.step()
        sparsifier.squash_mask()
    return model


ROWS = [
    ("dense", None),
    ("magnitude 50% (layer)", lambda m, c: prune_pass(m, c, method="magnitude", sparsity=0.5, n_calib=N_CALIB)),
    ("wanda 50% (layer)", lambda m, c: prune_pass(m, c, method="wanda", sparsity=0.5, n_calib=N_CALIB)),
    ("wanda 50% (global)", lambda m, c: prune_pass(m, c, method="wanda", sparsity=0.5, scope="global", n_calib=N_CALIB)),
    ("torchao WandaSparsifier 50%", torchao_wanda),
    ("2:4 wanda", lambda m, c: prune_pass(m, c, method="2:4", n_calib=N_CALIB)),
    ("2:4 magnitude", lambda m, c: prune_pass(m, c, method="2:4-magnitude", n_calib=N_CALIB)),
    ("heads -25%", lambda m, c: prune_structured_pass(m, c, target="heads", amount=0.25, n_calib=N_CALIB)),
    ("channels -25%", lambda m, c: prune_structured_pass(m, c, target="channels", amount=0.25, n_calib=N_CALIB)),
    ("blocks -1", lambda m, c: prune_structured_pass(m, c, target="blocks", amount=1, n_calib=N_CALIB)),
]


def section(model_dir: str, *, eval_tokens: int = 32768, max_corpus_bytes: int = 4 << 20, progress=None) -> list[dict]:
    """One row per pruning setting: name, val_bpb, ratio to dense, params, nonzero params, seconds to prune."""
    ctx = build_context(model_dir, max_corpus_bytes=max_corpus_bytes, eval_tokens=eval_tokens)
    rows = []
    for name, prune in ROWS:
        model = load_model(model_dir)
        t0 = time.perf_counter()
        if prune is not None:
            model = prune(model, ctx)
        seconds = time.perf_counter() - t0
        params = sum(p.numel() for p in model.parameters())
        nonzero = sum(int((p != 0).sum()) for p in model.parameters())
        sparsity, _ = sparsity_of(prunable_linears(model))
        rows.append({"name": name, **ctx.evaluate(model), "params": params, "nonzero": nonzero,
                     "linear_sparsity": sparsity, "prune_s": seconds})
        if progress is not None:
            progress(name)
    dense = rows[0]["val_bpb"]
    peer = next(r["val_bpb"] for r in rows if r["name"].startswith("torchao"))
    for r in rows:
        r["vs_dense"] = r["val_bpb"] / dense
        r["vs_torchao_wanda"] = r["val_bpb"] / peer
    return rows


def plot(rows: list[dict], path: str) -> None:
    """Bits per byte against non-zero parameters: numbered points, a key beside them, plain tick values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from prunus.train_parallel.plot import key_text, place_point_labels, plain_ticks, span_limits

    xs, ys = [r["nonzero"] / 1e6 for r in rows], [r["val_bpb"] for r in rows]
    fig, (ax, key) = plt.subplots(1, 2, figsize=(9, 4.5), layout="constrained", gridspec_kw={"width_ratios": [2.2, 1]})
    ax.plot(xs, ys, "o", color="tab:blue")
    ax.set_xlim(*span_limits(xs, min_span=0.1 * max(xs)))
    ax.set_ylim(*span_limits(ys, min_span=0.01 * min(ys)))  # at least 1% of bits per byte
    ax.set_xlabel("non-zero parameters (M)")
    ax.set_ylabel("validation bits per byte (lower is better)")
    ax.set_title("pruning: quality against size", fontsize=10)
    plain_ticks(ax)
    ax.grid(alpha=0.3)
    key_text(fig, key, [f"{i}: {r['name']}  {r['val_bpb']:.4f}" for i, r in enumerate(rows)])
    place_point_labels(fig, ax, xs, ys, [str(i) for i in range(len(rows))])
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/demo/model")
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--max-corpus-bytes", type=int, default=4 << 20)
    ap.add_argument("--plot", default="runs/compress_quality_prune.png")
    args = ap.parse_args()

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    with Progress(transient=True) as bar:
        task = bar.add_task("pruning and scoring", total=len(ROWS))
        rows = section(args.model, eval_tokens=args.eval_tokens, max_corpus_bytes=args.max_corpus_bytes,
                       progress=lambda name: bar.advance(task))
    table = Table(title=f"pruning quality on {args.model} ({rows[0]['val_tokens']} held-out tokens)", title_justify="left")
    for h in ("setting", "val bpb", "x dense", "x torchao wanda", "params", "nonzero", "Linear sparsity", "prune s"):
        table.add_column(h, justify="left" if h == "setting" else "right")
    for r in rows:
        table.add_row(r["name"], f"{r['val_bpb']:.4f}", f"{r['vs_dense']:.3f}", f"{r['vs_torchao_wanda']:.3f}",
                      f"{r['params']:,}", f"{r['nonzero']:,}", f"{r['linear_sparsity']:.1%}", f"{r['prune_s']:.1f}")
    Console(width=140).print(table)
    wanda = next(r for r in rows if r["name"] == "wanda 50% (layer)")
    print(f"wanda 50% / dense = {wanda['vs_dense']:.3f} (goal <= 1.15: {'met' if wanda['vs_dense'] <= 1.15 else 'missed'}); "
          f"wanda 50% / torchao WandaSparsifier 50% = {wanda['vs_torchao_wanda']:.3f}")
    os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
    plot(rows, args.plot)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
