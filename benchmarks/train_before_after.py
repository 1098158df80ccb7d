"""Training speed of this checkout beside an earlier commit of prunus, on the same tiny runs, in one run.

Two runs through each tree's Python API, one process each, rounds alternating the trees (as
:mod:`benchmarks.code_before_after` does for decoding): a generic module (an MLP, ``train_module`` on a
synthetic classification set) and the tiny transformer (``train``, preset tiny, the built-in corpus). The
figure is optimizer steps per second of the training steps alone (the run's ``elapsed_s``: setup,
evaluation and the model dir left out). Printed: median and range per tree and the ratio this / earlier.
Never fails on a timing.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.train_before_after --ref e3d1a06
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from torch import nn

from benchmarks.code_before_after import ROOT, _link_this
from benchmarks.harness import alternating_rounds, git_tree, machine_line, median_range

_WORKER = r"""
import json, sys, tempfile
kind, steps = sys.argv[1], int(sys.argv[2])
out = tempfile.mkdtemp() + "/run"
if kind == "module":
    from prunus.data.synthetic import synthetic_datasets
    from prunus.train_parallel.module_config import ModuleTrainConfig
    from prunus.train_parallel.module_trainer import train_module
    train, val = synthetic_datasets("synthetic:classification?n=2048&shape=64&classes=10&val=256")
    cfg = ModuleTrainConfig(out=out, batch_size=64, steps=steps, warmup_steps=10, eval_every=steps, ckpt_every=0,
                            progress=False, device="cpu")
    result = train_module("benchmarks.train_before_after:mlp", train, "classification", cfg, val_dataset=val)
else:
    from prunus.train_parallel import TrainConfig, train
    result = train(TrainConfig(out=out, preset="tiny", steps=steps, seq_len=64, batch_size=8, warmup_steps=10,
                               eval_every=steps, eval_tokens=2048, ckpt_every=0, progress=False, device="cpu",
                               max_corpus_bytes=1 << 20))
print(json.dumps({"steps_s": steps / result.metrics["elapsed_s"]}))
"""


def mlp(d_in: int = 64, width: int = 256, classes: int = 10) -> nn.Module:
    """The generic module trained: two hidden layers of ``width``."""
    return nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, classes))


def _one(tree: Path, kind: str, steps: int, threads: int) -> float | None:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(tree)}
    r = subprocess.run([sys.executable, "-c", _WORKER, kind, str(steps)], capture_output=True, text=True, env=env,
                       cwd=ROOT)  # prunus from ``tree`` (first on the path); the factory's module from this checkout
    if r.returncode != 0:
        print(f"  {kind} failed in {tree}: {r.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])["steps_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", required=True, help="the earlier commit")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(machine_line())
    print(f"training steps/s, {args.steps} steps, {args.threads} thread(s), median of {args.rounds} rounds; "
          f"earlier = {args.ref}", flush=True)
    with tempfile.TemporaryDirectory(prefix="prunus-before-") as tmp:
        trees = {"this": ROOT.parent if (ROOT.parent / "prunus").exists() else _link_this(Path(tmp)),
                 "earlier": git_tree(args.ref, Path(tmp))}
        try:
            for kind in ("module", "transformer"):
                got = alternating_rounds({name: (lambda tree=tree: _one(tree, kind, args.steps, args.threads))
                                          for name, tree in trees.items()}, args.rounds)
                ratio = (statistics.median(got["this"]) / statistics.median(got["earlier"])
                         if got["this"] and got["earlier"] else float("nan"))
                print(f"{kind:12s} this {median_range(got['this'], '.2f'):>22s}  earlier "
                      f"{median_range(got['earlier'], '.2f'):>22s}  this/earlier {ratio:.2f}x", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(tmp) / "earlier-tree")],
                           capture_output=True)


if __name__ == "__main__":
    main()
