"""The native kernels' row groupings: the fixed rules against the plan measured on this machine, per layer shape and
row count, and for whole decode steps.

The plan is measured as a load measures it (:func:`prunus.native.plan.calibrate`, the cache left alone), then each
layer shape of the model at each row count (1, 2, 3, 4, 5, 6, 8, 16: the buckets' first rows) runs with the fixed
rules' grouping and with the plan's, in alternating rounds, each figure the median of ``--calls`` samples as the
calibration takes them (a call's mean over three of the shape's layers in turn; the head: slices of its tiles); a
row count where the plan keeps the fixed rule is not timed.
Then decode steps of ``--batches`` rows over the whole model, without and with the plan. Printed: the CPU, the kernel
path, the threads, each time's median (range) and the ratio calibrated / default (``≈``: the ranges overlap).

    python -m benchmarks.native_plan EXPORT_DIR [--threads 2] [--rounds 5] [--calls 10] [--batches 1,2,4,6,8,16]
    python -m benchmarks.native_plan --random-smollm2     # random int8 weights of SmolLM2-135M's shapes
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import numpy as np

from benchmarks.harness import alternating_rounds, machine_line, median_range, median_ratio, show

ROWS = (1, 2, 3, 4, 5, 6, 8, 16)
WORDS = {0: "rows", 2: "pairs", 6: "pairs+prefetch", 3: "wide+pairs", 7: "wide+pairs+prefetch"}


def grouping(code: int) -> str:
    from prunus.native.plan import PAIRS, PREFETCH, THREE, WIDE

    bits = ((WIDE, "wide"), (THREE, "three"), (PAIRS, "pairs"), (PREFETCH, "prefetch"))
    return WORDS.get(code) or "+".join(w for b, w in bits if code & b) or "rows"


def load_packed(export: Path | None, max_len: int):
    """The export's packed weights and dims, or random SmolLM2-135M-shaped int8 ones."""
    if export is None:
        from benchmarks.native_kv_cache import random_smollm2

        return random_smollm2(max_len)
    from prunus.export.export_dir import export_dims
    from prunus.native.weights import native_weights_file, read_native_weights

    dims = export_dims(export, json.loads((export / "config.json").read_text())["export"])
    return read_native_weights(native_weights_file(export), dims), dims


def shape_rows(dec, plans: dict, args) -> list[list[str]]:
    """Per shape and row count: the two groupings, their kernel times and the ratio."""
    from prunus.native.plan import _Timer, by_shape, fixed_rule

    table = []
    for key, lins in by_shape(dec.packed).items():
        timer = _Timer(dec.lib, dec.pool, lins)
        kind = lins[0].kind
        for m in ROWS:
            rule, ours = fixed_rule(kind, m), plans[key][min(m, 16)]
            if rule == ours:
                table.append([key, str(m), grouping(rule), "same", "", "", "1 (not timed)"])
                continue
            fns = {c: (lambda c=c: 1e3 * float(np.median([timer(c, m) for _ in range(args.calls)])))
                   for c in (rule, ours)}
            got = alternating_rounds(fns, args.rounds)
            table.append([key, str(m), grouping(rule), grouping(ours), median_range(got[rule], ".3f"),
                          median_range(got[ours], ".3f"), median_ratio(got[ours], got[rule])])
    return table


def step_ms(dec, batch: int, steps: int) -> float:
    """The median of ``steps`` decode steps of ``batch`` rows at position 16, in ms."""
    logits = np.zeros((batch, dec.vocab_size), np.float32)
    ids = np.full((batch, 1), 42, np.int64)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        dec.forward(ids, np.full(batch, 16, np.int32), np.ones(batch, np.int32), 0, logits)
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def step_rows(dec, plan, args) -> list[list[str]]:
    """Per batch: decode step time without the plan (the fixed rules) and with it, and the ratio."""
    table = []
    for b in args.batches:
        def run(p, b=b):
            dec.use_plan(p)
            return step_ms(dec, b, args.steps)

        got = alternating_rounds({"default": lambda: run(None), "calibrated": lambda: run(plan)}, args.rounds)
        table.append([str(b), median_range(got["default"], ".2f"), median_range(got["calibrated"], ".2f"),
                      median_ratio(got["calibrated"], got["default"])])
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path, nargs="?", help="a genai export dir (with native_weights.safetensors)")
    ap.add_argument("--random-smollm2", action="store_true", help="random weights of SmolLM2-135M's shapes instead")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10, help="samples per figure (their median)")
    ap.add_argument("--steps", type=int, default=10, help="decode steps per figure (their median)")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 6, 8, 16])
    args = ap.parse_args()
    if (args.export is None) == (not args.random_smollm2):
        ap.error("give an export dir or --random-smollm2 (one of them)")
    from prunus.native.build import isa
    from prunus.native.decoder import NativeDecoder
    from prunus.native.plan import Plan, calibrate

    packed, dims = load_packed(args.export, 64)
    n = max(args.batches)
    kv = [np.zeros((n, dims["n_kv_heads"], 64, dims["head_dim"]), np.float32) for _ in range(2 * dims["n_layers"])]
    dec = NativeDecoder(packed, kv[::2], kv[1::2], n, 64, args.threads)
    try:
        t0 = time.perf_counter()
        plans, complete = calibrate(packed, dec.lib, dec.pool)
        took = time.perf_counter() - t0
        print(machine_line())
        print(f"{args.export or 'random SmolLM2-135M-shaped int8 (fp32 head)'}: kernel path {isa()}, {args.threads} "
              f"threads; calibration {took:.2f} s ({'complete' if complete else 'budget spent'}), {args.rounds} "
              f"alternating rounds")
        show("kernel ms per call, default (fixed rules) vs calibrated",
             ["shape", "rows", "default", "calibrated", "default ms", "calibrated ms", "ratio"],
             shape_rows(dec, plans, args))
        show("decode step ms (position 16)", ["batch", "default ms", "calibrated ms", "ratio"],
             step_rows(dec, Plan(plans, "calibrated"), args))
    finally:
        dec.close()


if __name__ == "__main__":
    main()
