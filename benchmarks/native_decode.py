"""The native decoder on a real model: its kernels, its whole steps beside ONNX Runtime's, and the CPU's ceiling.

On SmolLM2-135M's genai exports (fp32, int8 by ``--precision int8``, stored int4 round-to-nearest in groups of
32 with an int8 head: the same dirs ``serve_throughput.py --peer llamacpp`` makes and caches):

1. **Kernels**: every q / o / gate / down layer of the export one after another (so the weights come from memory,
   as in a decode step), one thread, at 1, 2, 4 and 8 rows: ms per sweep and billions of products a second.
2. **Whole decode steps**: ``GenaiSession`` on the same export with and without ``native=True``, ``--threads``
   threads, batch 1 and 8 after a 7-token prompt, and batch 1 at ``--long`` positions. Median of 20 steps, best
   of ``--rounds`` alternating rounds.
3. **Ceiling**: the int8 block product of the kernels (``sign``, ``maddubs``, ``madd``, ``cvt``, FMA, with eight
   independent accumulators) in registers, and the FMA peak, compiled with the same compiler: cycles per block at
   the clock the FMA loop shows (two FMAs a cycle). That bounds what 8 rows of int8 products can reach here.

Timings never fail the run; time on an idle machine (``OMP_WAIT_POLICY=PASSIVE`` is set).

    python -m benchmarks.native_decode [--model smollm2] [--cache runs/real-models] [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import numpy as np

PRECISIONS = ("fp32", "int8", "int4")


def genai_exports(model_dir: Path, cache: Path) -> dict[str, Path]:
    """The fp32, int8 and int4 genai exports of ``model_dir``, made once (``serve_throughput.py``'s cache)."""
    from benchmarks.serve_throughput import _export_root, cached_int4, cached_onnx

    root, _ = _export_root(model_dir, cache)
    int4_dir = cached_int4(model_dir, cache)
    jobs = {"fp32": (model_dir, "fp32", "fp32"), "int8": (model_dir, "int8", "int8"),
            "int4": (int4_dir, None, "int4-rtn-g32-head8")}
    return {p: cached_onnx(src, root, name, asked, "genai") for p, (src, asked, name) in jobs.items()}


def _graph_and_dims(export: Path):
    from prunus.runtime.artifact import export_dims

    config = json.loads((export / "config.json").read_text())["export"]
    dims = export_dims(export, config)
    return export / config["graphs"]["model"], {k: dims[k] for k in ("n_layers", "n_kv_heads", "head_dim", "vocab_size")}


def kernels_section(exports: dict, rounds: int) -> None:
    from prunus.native.build import library
    from prunus.native.decoder import _linear
    from prunus.native.weights import native_weights_file, read_native_weights

    print("\n1. kernels: every q / o / gate / down layer in turn (weights from memory), one thread, best of "
          f"{rounds}")
    lib, rng = library(), np.random.default_rng(0)
    pool = lib.prunus_pool_new(1)
    for precision, export in exports.items():
        _, dims = _graph_and_dims(export)
        packed = read_native_weights(native_weights_file(export), dims)
        layers = [layer[n] for layer in packed.layers for n in ("q", "o", "gate", "down") if layer[n] is not None]
        structs = [_linear(lin) for lin in layers]
        cells = []
        for m in (1, 2, 4, 8):
            xs = [rng.standard_normal((m, lin.k)).astype(np.float32) for lin in layers]
            ys = [np.zeros((m, lin.n), np.float32) for lin in layers]
            best = float("inf")
            for _ in range(rounds):
                t0 = time.perf_counter()
                for c, x, y in zip(structs, xs, ys):
                    lib.prunus_linear(ctypes.addressof(c), pool, m, x.ctypes.data, y.ctypes.data)
                best = min(best, time.perf_counter() - t0)
            products = m * sum(lin.n * lin.k for lin in layers)
            cells.append(f"{m} rows {best * 1e3:6.2f} ms ({products / best / 1e9:5.1f} G/s)")
        print(f"   {precision:5s} " + "  ".join(cells))
    lib.prunus_pool_free(pool)


def _step_times(sess, b: int, start: int, rng, steps: int = 20) -> float:
    lengths = np.full(b, start, np.int64)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        sess.decode(lengths + i, rng.integers(0, 1000, b))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def steps_section(exports: dict, threads: int, rounds: int, long: int) -> None:
    from prunus.runtime.genai_session import GenaiSession
    from prunus.runtime.native import NativeSession

    print(f"\n2. whole decode steps, {threads} threads, ms (median of 20 steps, best of {rounds} alternating rounds)")
    rng = np.random.default_rng(0)
    cases = [(1, 7), (8, 7), (1, long)]
    for precision, export in exports.items():
        graph, dims = _graph_and_dims(export)
        sessions = {name: cls(graph, **dims, n_slots=8, max_len=long + 32, threads=threads)
                    for name, cls in (("onnxruntime", GenaiSession), ("native", NativeSession))}
        for sess in sessions.values():  # 7 tokens in every row, then row 0's cache filled to the long position
            sess.prefill(0, [list(rng.integers(0, 1000, 7)) for _ in range(8)])
            sess.prefill(0, [list(rng.integers(0, 1000, long))])
        best = {}
        for _ in range(rounds):
            for name, sess in sessions.items():
                for b, start in cases:
                    time.sleep(0.25)  # the other runtime's spinning threads settle
                    t = _step_times(sess, b, start, rng)
                    best[(name, b, start)] = min(best.get((name, b, start), t), t)
        for b, start in cases:
            o, n = best[("onnxruntime", b, start)] * 1e3, best[("native", b, start)] * 1e3
            print(f"   {precision:5s} batch {b} at position {start:5d}: native {n:6.2f}  onnxruntime {o:6.2f}  "
                  f"onnxruntime / native {o / n:.2f}x")
        for sess in sessions.values():
            sess.close()


CEILING_C = r"""
#define _POSIX_C_SOURCE 199309L
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define N 20000000L
/* FMA instructions a second: ten independent chains */
__attribute__((noinline)) static double fma_rate(void) {
#define F(i) __m256 f##i = _mm256_set1_ps(i * 1e-3f);
    F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9)
    const __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(1e-6f);
#define STEP(i) f##i = _mm256_fmadd_ps(f##i, b, c);
    double t0 = now();
    for (long i = 0; i < 10 * N; i++) {
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7) STEP(8) STEP(9)
        __asm__ volatile("" : "+x"(f0), "+x"(f1), "+x"(f2), "+x"(f3), "+x"(f4), "+x"(f5), "+x"(f6), "+x"(f7),
                              "+x"(f8), "+x"(f9));
    }
    double t = now() - t0;
    volatile float keep = f0[0] + f1[0] + f2[0] + f3[0] + f4[0] + f5[0] + f6[0] + f7[0] + f8[0] + f9[0];
    (void)keep;
    return 100.0 * N / t;
}

/* int8 blocks of 32 a second, as the kernels' pair loop does them: 4 weight blocks x 2 activation rows */
__attribute__((noinline)) static double block_rate(void) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    __m256i w[4], x0 = _mm256_set1_epi8(3), x1 = _mm256_set1_epi8(-5);
    for (int i = 0; i < 4; i++) w[i] = _mm256_set1_epi8(i - 2);
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256 s = _mm256_set1_ps(0.01f);
    double t0 = now();
    for (long it = 0; it < N; it++) {
        __m256i xa = _mm256_xor_si256(x0, _mm256_set1_epi8((char)it)), xb = _mm256_xor_si256(x1, _mm256_set1_epi8((char)it));
        for (int i = 0; i < 4; i++) {
            __m256i aw = _mm256_abs_epi8(w[i]);
            __m256 p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xa, w[i])), ones));
            __m256 p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb, w[i])), ones));
            acc[i] = _mm256_fmadd_ps(p0, s, acc[i]);
            acc[4 + i] = _mm256_fmadd_ps(p1, s, acc[4 + i]);
        }
        __asm__ volatile("" : "+x"(w[0]), "+x"(w[1]), "+x"(w[2]), "+x"(w[3]));
    }
    double t = now() - t0;
    volatile float keep = 0;
    for (int i = 0; i < 8; i++) keep += acc[i][0];
    return 8.0 * N / t;
}

int main(void) {
    printf("%.6g %.6g\n", fma_rate(), block_rate());
    return 0;
}
"""


def ceiling_section() -> None:
    from prunus.native.build import FLAGS, _compiler

    print("\n3. ceiling: one core, in registers")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "ceiling.c", Path(tmp) / "ceiling"
        src.write_text(CEILING_C)
        flags = [f for f in FLAGS if f not in ("-fPIC", "-shared")]
        built = subprocess.run([*_compiler(), *flags, str(src), "-o", str(exe)], capture_output=True, text=True)
        if built.returncode != 0:
            print(f"   not compiled: {(built.stderr.strip().splitlines() or ['no output'])[0]}")
            return
        fma, blocks = map(float, subprocess.run([str(exe)], capture_output=True, text=True).stdout.split()[:2])
    ghz = fma / 2 / 1e9
    print(f"   FMA: {fma / 1e9:.2f} G instructions/s ({fma * 8 / 1e9:.1f} G fp32 products/s): about {ghz:.2f} GHz "
          f"at two a cycle")
    print(f"   int8 block of 32 (sign, maddubs, madd, cvt, FMA): {blocks / 1e9:.2f} G blocks/s, "
          f"{ghz * 1e9 / blocks:.2f} cycles each: at most {blocks * 32 / 1e9:.1f} G int8 products/s per core")


def main() -> None:
    from benchmarks.real_model import DEFAULT_CACHE, resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--cache", default=DEFAULT_CACHE)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--long", type=int, default=2000, help="the position of the long-context steps")
    args = ap.parse_args()
    from prunus.native.build import unavailable

    why = unavailable()
    if why is not None:
        print(f"native kernels unavailable here: {why}")
        return
    exports = {p: d for p, d in genai_exports(resolve_model(args.model, args.cache), Path(args.cache)).items() if d}
    kernels_section(exports, args.rounds)
    steps_section(exports, args.threads, args.rounds, args.long)
    ceiling_section()


if __name__ == "__main__":
    main()
