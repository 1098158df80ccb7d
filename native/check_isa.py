"""Every kernel path this CPU runs, checked and timed: ``python -m prunus.native.check_isa``.

For each path (:data:`prunus.native.build.ISAS` that the CPU has), the int8, int4 (with zero points) and fp32
linear kernels run on the same random buffers; each result is compared with numpy's (the same block-quantized
activations, in float64) and with the AVX2 path's, and timed: the best of a few rounds, one thread unless
``--threads``, a 1536 x 576 layer (SmolLM2-135M's feed-forward) at 1, 8 and 32 rows (a decode step, a batch, a
short prompt; AMX takes passes of 16 rows or more). One line per path, under a line naming the CPU. Needs numpy
and a C compiler only; exits 1 when a path is further from numpy than the tolerance.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import numpy as np

from .build import cpu_model, isa, library, set_isa, supported_isas
from .decoder import _linear
from .weights import PackedLinear, pack_blocks, pack_f32

TOLERANCE = 1e-5  # largest |error| over the largest |reference|, every path


def _blocks_reference(x: np.ndarray) -> np.ndarray:
    """x as the integer kernels see it (float64): blocks of 32 rounded to amax / 127 steps, in float32 as they do."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    q = np.round(blocks * inverse)
    return (q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)


def layers(n: int, k: int, seed: int = 0) -> dict:
    """The three kinds of layer, each with its float64 weights: name -> (packed, w (n, k), quantized inputs?)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, bits in (("int8", 8), ("int4", 4)):
        q = rng.integers(0, 2 ** bits, (n, k)).astype(np.uint8)
        scale = rng.uniform(0.01, 0.1, (n, k // 32)).astype(np.float32)
        zero = rng.integers(0, 2 ** bits, (n, k // 32)).astype(np.float32)
        w = (q.astype(np.float64) - np.repeat(zero, 32, 1)) * np.repeat(scale, 32, 1)
        out[name] = (pack_blocks(q, scale, zero, bits), w, True)
    w = rng.standard_normal((n, k)).astype(np.float32)
    out["fp32"] = (pack_f32(w), w.astype(np.float64), False)
    return out


def run(packed: PackedLinear, x: np.ndarray, pool) -> np.ndarray:
    y = np.zeros((x.shape[0], packed.n), np.float32)
    c = _linear(packed)
    library().prunus_linear(ctypes.addressof(c), pool, x.shape[0], x.ctypes.data, y.ctypes.data)
    return y


def best_time(packed: PackedLinear, x: np.ndarray, pool, rounds: int, calls: int) -> float:
    """Seconds per call, the best of ``rounds`` rounds of ``calls`` calls."""
    c, y, lib = _linear(packed), np.zeros((x.shape[0], packed.n), np.float32), library()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            lib.prunus_linear(ctypes.addressof(c), pool, x.shape[0], x.ctypes.data, y.ctypes.data)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def check(n: int = 1536, k: int = 576, rows: tuple = (1, 8, 32), rounds: int = 5, calls: int = 20,
          threads: int = 1) -> list[dict]:
    """One record per path: per kind, the error against numpy and against AVX2, and the time per row count."""
    kinds = layers(n, k)
    rng = np.random.default_rng(1)
    xs = {m: rng.standard_normal((m, k)).astype(np.float32) for m in rows}
    lib, before, records = library(), isa(), []
    pool = lib.prunus_pool_new(threads)
    try:
        set_isa("avx2")
        base = {(kind, m): run(p, xs[m], pool) for kind, (p, _, _) in kinds.items() for m in rows}
        for path in supported_isas():
            set_isa(path)
            rec = {"path": path}
            for kind, (p, w, quantized) in kinds.items():
                errs, ref_errs = [], []
                for m in rows:
                    got = run(p, xs[m], pool)
                    want = (_blocks_reference(xs[m]) if quantized else xs[m].astype(np.float64)) @ w.T
                    errs.append(np.abs(got - want).max() / np.abs(want).max())
                    ref_errs.append(np.abs(got - base[kind, m]).max() / np.abs(want).max())
                rec[kind] = {"err": max(errs), "vs_avx2": max(ref_errs),
                             "us": {m: 1e6 * best_time(p, xs[m], pool, rounds, calls) for m in rows}}
            records.append(rec)
    finally:
        lib.prunus_pool_free(pool)
        set_isa(before)
    return records


def line(rec: dict) -> str:
    parts = [f"{rec['path']:<11}"]
    for kind in ("int8", "int4", "fp32"):
        r = rec[kind]
        times = " ".join(f"{us:.0f}" for us in r["us"].values())
        parts.append(f"{kind} err {r['err']:.1e} (vs avx2 {r['vs_avx2']:.1e}) {times} us")
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1536, help="output rows of the layer (default 1536)")
    ap.add_argument("--k", type=int, default=576, help="inputs, a multiple of 32 (default 576)")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds, the best one counts (default 5)")
    ap.add_argument("--threads", type=int, default=1, help="threads of the kernels' pool (default 1)")
    args = ap.parse_args(argv)
    rows = (1, 8, 32)
    print(f"CPU: {cpu_model()}; paths it runs: {', '.join(supported_isas())}; chosen at load: {isa()}; "
          f"{args.n} x {args.k} layer, {args.threads} thread(s), times for {' and '.join(map(str, rows))} rows; "
          f"error = max |y - numpy| / max |numpy|")
    records = check(args.n, args.k, rows, args.rounds, threads=args.threads)
    for rec in records:
        print(line(rec))
    worst = max(rec[kind]["err"] for rec in records for kind in ("int8", "int4", "fp32"))
    print(f"{'ok' if worst <= TOLERANCE else 'FAILED'}: largest error {worst:.1e} (tolerance {TOLERANCE:.0e})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
