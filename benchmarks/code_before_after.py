"""Decode speed of this checkout beside an earlier commit of prunus, on the same artifacts, in one run.

A refactor promises "unchanged or better": this puts a number on it. The earlier commit is checked
out into a temporary git worktree; each contender (tree x runtime) runs in a process of its own with
that tree first on ``sys.path``, and rounds alternate the trees so that drift on a shared machine
falls on both. Printed: tokens/s per runtime and batch for each tree (median of the rounds, with the
range) and the ratio this / earlier (training speed: :mod:`benchmarks.train_before_after`). Never fails on a
timing.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.code_before_after --ref 67f88c4 \\
        --case torch=runs/real-models/smollm2-135m-instruct/model --case ort=EXPORT_DIR --case native=EXPORT_DIR
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

from benchmarks.harness import alternating_rounds, git_tree, machine_line, median_range

ROOT = Path(__file__).resolve().parents[1]

_WORKER = r"""
import json, sys, time
tree, path, kind, batch, tokens, threads = sys.argv[1:7]
sys.path.insert(0, tree)
from prunus.serve import Engine
engine = Engine.load(path, threads=int(threads), max_batch=max(8, int(batch)), native=(kind == "native"),
                     compile=False)
prompts = ["def read_config(path):", "The history of the city", "import numpy as np", "Once upon a time"] * 2
prompts = prompts[: int(batch)]
engine.generate(prompts, max_new_tokens=4, ignore_eos=True)  # warm up
t0 = time.perf_counter()
out = engine.generate(prompts, max_new_tokens=int(tokens), ignore_eos=True)
dt = time.perf_counter() - t0
n = sum(len(r.token_ids) for r in (out if isinstance(out, list) else [out]))
print(json.dumps({"tok_s": n / dt}))
engine.close()
"""


def _one(tree: Path, path: str, kind: str, batch: int, tokens: int, threads: int) -> float | None:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(threads)}
    r = subprocess.run([sys.executable, "-c", _WORKER, str(tree), path, kind, str(batch), str(tokens), str(threads)],
                       capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    if r.returncode != 0:
        print(f"  {kind} failed in {tree}: {r.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    time.sleep(0.25)
    return json.loads(r.stdout.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", required=True, help="the earlier commit")
    ap.add_argument("--case", action="append", required=True, metavar="torch|ort|native=DIR")
    ap.add_argument("--batch", default="1,8", type=lambda v: [int(b) for b in v.split(",")])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cases = [c.split("=", 1) for c in args.case]
    with tempfile.TemporaryDirectory(prefix="prunus-before-") as tmp:
        earlier = git_tree(args.ref, Path(tmp))
        trees = {"this": ROOT.parent if (ROOT.parent / "prunus").exists() else _link_this(Path(tmp)), "earlier": earlier}
        try:
            _run(args, cases, trees)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(tmp) / "earlier-tree")],
                           capture_output=True)


def _link_this(tmp: Path) -> Path:
    (tmp / "this").mkdir()
    (tmp / "this" / "prunus").symlink_to(ROOT)
    return tmp / "this"


def _run(args, cases, trees) -> None:
    print(machine_line())
    print(f"decode tokens/s, {args.tokens} new tokens, {args.threads} thread(s), median of {args.rounds} rounds; "
          f"earlier = {args.ref}", flush=True)
    for kind, path in cases:
        for batch in args.batch:
            got = alternating_rounds({name: (lambda tree=tree: _one(tree, path, kind, batch, args.tokens, args.threads))
                                      for name, tree in trees.items()}, args.rounds)
            ratio = (statistics.median(got["this"]) / statistics.median(got["earlier"])
                     if got["this"] and got["earlier"] else float("nan"))
            print(f"{kind:7s} batch {batch}: this {median_range(got['this']):>20s}  earlier {median_range(got['earlier']):>20s}  "
                  f"this/earlier {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()
