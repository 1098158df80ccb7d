"""int8, pruned and distilled exports of the four model kinds of :mod:`benchmarks._prune_models`, beside ONNX
Runtime's ``quantize_static`` used directly.

Per model kind (trained by prunus's generic trainer, as in :mod:`benchmarks.prune_vs_torch_pruning`):

* **fp32**: ``prunus export`` of the trained model dir (ONNX Runtime);
* **prunus int8**: ``prunus export --precision int8`` (static QDQ after BatchNorm folding for graphs with
  convolutions, else dynamic; see ``docs/export.md``), calibrated on 128 samples spread over the training split;
* **quantize_static int8**: ONNX Runtime's ``quantize_static`` with its defaults on the same fp32 graph and the same
  128 calibration samples;
* **pruned fp32**: ``prunus compress`` (``prune_channels``, ``--amount`` of the channels, ``--finetune-steps``)
  then ``prunus export``;
* **distilled fp32** (classifiers): ``distill_module`` into the same factory at ``--student-width``, then export.

Prints the held-out metric (accuracy, or MSE for the regressors), graph bytes and ONNX Runtime latency at batch 1
and 64 (one intra-op thread, the graphs alternating), and the ratios prunus int8 / quantize_static.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.int8_vs_quantize_static [--only NAME,...] [--reps 100] [--json F]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import numpy as np
import torch

from benchmarks._prune_models import KINDS, stacked, train
from benchmarks.any_model_digits import ort_session, quantize_peer
from benchmarks.harness import alternating_samples, machine_line, show, spread, write_results


def compressed(kind, model_dir: Path, data: str, root: Path, args) -> dict[str, Path]:
    """The pruned (and, for a classifier, the distilled) model dirs of ``model_dir``."""
    from prunus.compress import compress

    prune = {"amount": args.amount, "finetune_steps": args.finetune_steps, "lr": 3e-3, "batch_size": 64}
    dirs = {"pruned": compress(model_dir, [("prune_channels", prune)], root / f"{kind.name}-pruned",
                               data=data, trust_factory=True, latency=False)["out"]}
    if kind.task == "classification":
        student = {"student": kind.spec, "student_args": {"width": args.student_width}, "steps": args.distill_steps,
                   "lr": 3e-3, "batch_size": 64}
        dirs["distilled"] = compress(model_dir, [("distill_module", student)], root / f"{kind.name}-distilled",
                                     data=data, trust_factory=True, latency=False)["out"]
    return {k: Path(v) for k, v in dirs.items()}


def graphs(kind, model_dir: Path, data: str, root: Path, train_x: torch.Tensor, args) -> dict[str, Path]:
    """Every contender's ONNX graph (see the module docstring)."""
    from prunus.export import export_model
    from prunus.export.module_int8 import CALIB_SAMPLES, spread_indices

    def export(src, name, precision=None):
        from prunus.export.parity import ParityFailed

        try:
            export_model(src, root / name, precision=precision, trust_factory=True, data=data, progress=False)
        except ParityFailed as e:  # measured all the same, and said
            print(f"{name}: prunus export refuses it by default ({e}); measured with --no-verify")
            export_model(src, root / name, precision=precision, trust_factory=True, data=data, progress=False,
                         verify=False, overwrite=True)
        return root / name / "model.onnx"

    fp32 = export(model_dir, f"{kind.name}-fp32")
    calibration = train_x[spread_indices(len(train_x), CALIB_SAMPLES)]
    out = {"fp32": fp32, "prunus int8": export(model_dir, f"{kind.name}-int8", "int8"),
           "quantize_static int8": quantize_peer(fp32, root / f"{kind.name}-peer.onnx", calibration)}
    for name, src in compressed(kind, model_dir, data, root, args).items():
        out[f"{name} fp32"] = export(src, f"{kind.name}-{name}-fp32")
    return out


def score(session, x: torch.Tensor, y: torch.Tensor, task: str) -> float:
    out = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    if task == "classification":
        return float((out.argmax(-1) == y).float().mean())
    return float(torch.nn.functional.mse_loss(out.float(), y.reshape(out.shape).float()))


def run_kind(kind, root: Path, args) -> dict:
    """Train ``kind``, make every graph; its figures per graph."""
    from prunus.data.module_datasets import module_datasets

    data = kind.data(root)
    tr, val = module_datasets(data, task=kind.task)
    (train_x, _), (val_x, val_y) = stacked(tr), stacked(val)
    model_dir = train(kind, data, root / kind.name)
    paths = graphs(kind, model_dir, data, root, train_x, args)
    sessions = {k: ort_session(p) for k, p in paths.items()}
    rows = {k: {"metric": score(s, val_x, val_y, kind.task), "bytes": paths[k].stat().st_size}
            for k, s in sessions.items()}
    for batch in (1, 64):
        x = val_x[:batch].numpy()
        fns = {k: (lambda s=s: s.run(None, {s.get_inputs()[0].name: x})) for k, s in sessions.items()}
        for k, times in alternating_samples(fns, args.reps).items():
            rows[k][f"latency_b{batch}"] = times
    return {"metric": kind.metric, "graphs": rows}


def us(samples: list[float]) -> str:
    """Median [interquartile range] of seconds, in microseconds."""
    lo, mid, hi = spread(samples)
    return f"{mid * 1e6:,.0f} [{lo * 1e6:,.0f}–{hi * 1e6:,.0f}]"


def report(results: dict) -> None:
    med = lambda v: float(np.median(v))  # noqa: E731
    for name, r in results.items():
        g = r["graphs"]
        show(f"{name} (held-out {r['metric']}; ONNX Runtime, 1 thread)",
             ["graph", r["metric"], "bytes", "µs batch 1", "µs batch 64"],
             [[k, f"{v['metric']:.4f}", f"{v['bytes']:,}", us(v["latency_b1"]), us(v["latency_b64"])]
              for k, v in g.items()], width=110)
        a, b = g["prunus int8"], g["quantize_static int8"]
        better = a["metric"] / b["metric"] if r["metric"] == "accuracy" else b["metric"] / a["metric"]
        print(f"prunus int8 / quantize_static: quality {better:.3f} (above 1: prunus better), latency batch 1 "
              f"{med(a['latency_b1']) / med(b['latency_b1']):.3f}, batch 64 "
              f"{med(a['latency_b64']) / med(b['latency_b64']):.3f} (below 1: prunus faster)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--amount", type=float, default=0.5, help="share of channels the pruned graph loses")
    parser.add_argument("--finetune-steps", type=int, default=150, help="fine-tune steps after pruning (batch 64)")
    parser.add_argument("--student-width", type=int, default=24, help="the distilled classifiers' width")
    parser.add_argument("--distill-steps", type=int, default=300, help="distillation steps (batch 64)")
    parser.add_argument("--reps", type=int, default=100, help="latency repetitions per graph and batch size")
    parser.add_argument("--only", default=None, help="comma-separated model names")
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(machine_line())
    t0, results = time.perf_counter(), {}
    with tempfile.TemporaryDirectory(prefix="prunus-int8-bench-") as tmp:
        for kind in (k for k in KINDS if args.only is None or k.name in args.only.split(",")):
            results[kind.name] = run_kind(kind, Path(tmp), args)
            print(f"{kind.name}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    report(results)
    if args.json:
        write_results(args.json, vars(args), results)


if __name__ == "__main__":
    main()
