"""A model dir served by the native runtime directly (its weights packed at load, no export) beside the genai export's
native path, decode steps of the same size, on SmolLM2-135M.

For each precision, a model dir and its genai export (the same numbers: the export's native weights are the dir's
stored codes), ``--threads`` threads, batch 1 and 8 after a 7-token prompt:

* ``dir``: ``Engine.load(MODEL_DIR)``'s backend (:mod:`prunus.runtime.native_backend`, rows are slots);
* ``export``: ``Engine.load(EXPORT_DIR)``'s backend, the same runtime over ``native_weights.safetensors`` (before
  the native runtime had a backend of its own, this was the genai backend's native path: ``GenaiSession(native=True)``
  under ``GenaiBackend``, rows compacted into slots ``[0, n)``; docs/results.md has both side by side).

Decode tokens/s: the median of 20 timed steps, each contender's rounds alternating (``--rounds``), median and range
over rounds, with the ratio dir / export. Timings never fail the run; the machine may be shared.

    python -m benchmarks.native_backend --fp32 /tmp/smol/model-dir /tmp/smol/export-fp32 \\
        --int8 /tmp/smol/int8-q80 /tmp/smol/export-int8-q80 --int4 /tmp/smol/int4-hqq /tmp/smol/export-int4 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

STEPS, PROMPT = 20, [1, 2, 3, 4, 5, 6, 7]


def _steps_per_s(backend, b: int) -> float:
    """Decode tokens/s of ``b`` rows: the median of STEPS timed steps after a 7-token prompt each."""
    rows = list(range(b))
    backend.prefill(rows, [PROMPT] * b)
    times = []
    for i in range(STEPS):
        t0 = time.perf_counter()
        backend.decode(rows, [10 + i] * b)
        times.append(time.perf_counter() - t0)
    for r in rows:
        backend.release(r)
    return b / statistics.median(times)


def measure(model_dir: Path, export: Path, threads: int, rounds: int) -> dict:
    """{batch: {contender: [tokens/s per round]}} for one precision."""
    from benchmarks.harness import alternating_rounds
    from prunus.serve import Engine

    engines = {"dir": Engine.load(model_dir, max_batch=8, max_len=64, threads=threads),
               "export": Engine.load(export, max_batch=8, max_len=64, threads=threads)}
    backends = {name: e.backend for name, e in engines.items()}
    assert all(e.info["runtime"] == "native" for e in engines.values()), {n: e.info for n, e in engines.items()}
    out = {}
    try:
        for b in (1, 8):
            out[b] = alternating_rounds({n: (lambda be=be: _steps_per_s(be, b)) for n, be in backends.items()}, rounds)
    finally:
        for e in engines.values():
            e.close()
    return out


def main() -> None:
    from benchmarks.harness import machine_line, median_range, median_ratio

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for precision in ("fp32", "int8", "int4"):
        p.add_argument(f"--{precision}", nargs=2, metavar=("MODEL_DIR", "EXPORT_DIR"), type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(machine_line())
    print(f"decode tokens/s, {args.threads} threads, median of {STEPS} steps per round, median (range) of "
          f"{args.rounds} alternating rounds")
    for precision in ("fp32", "int8", "int4"):
        pair = getattr(args, precision)
        if pair is None:
            continue
        for b, got in measure(*pair, args.threads, args.rounds).items():
            peer = "export"
            cells = "  ".join(f"{n} {median_range(v, ',.1f')}" for n, v in got.items())
            print(f"  {precision:5s} batch {b}: {cells}  ratio dir / {peer}: {median_ratio(got['dir'], got[peer])}")


if __name__ == "__main__":
    main()
