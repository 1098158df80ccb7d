"""A prompt's first token: prunus's native kernels beside ONNX Runtime's genai graph and llama.cpp, per precision.

One prompt of ``--tokens`` token ids (512 by default), batch 1, the time from the ids to the last token's logits:

* **native**: :class:`prunus.native.decoder.NativeDecoder` ``forward`` of the whole prompt in one pass (one row,
  positions 0..T-1, keys and values written into its own buffers);
* **onnxruntime**: :class:`prunus.runtime.genai_session.GenaiSession` ``prefill`` of the same ids through the
  export's genai graph (the same weights; ``native=False``);
* **llama.cpp**: llama-cpp-python in its own process (``_llamacpp_worker.py``), one ``llama_batch`` of the ids,
  timed inside the worker (fp32 / int8 / int4 against F32 / Q8_0 / Q4_0 GGUF files).

Rounds alternate the contenders; each cell is the median (and range) of ``--rounds`` rounds at each thread count,
with native / onnxruntime and native / llama.cpp ratios (under 1: native is faster). The CPU model and the load
average are printed with the figures. Time on an idle machine (``OMP_WAIT_POLICY=PASSIVE`` is set).

    python -m benchmarks.native_prefill --export int8=/tmp/smol/int8-genai --gguf int8=/tmp/smol/model-q8_0.gguf \\
        --llamacpp-python /work/llvenv/bin/python [--threads 1 2] [--rounds 3] [--tokens 512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import numpy as np

from benchmarks.harness import cpu_model

PRECISIONS = ("fp32", "int8", "int4")
SETTLE_S = 0.25  # idle seconds before each timed run: the previous runtime's threads stop spinning


def _pairs(items: list[str], what: str) -> dict[str, Path]:
    out = {}
    for item in items:
        precision, sep, path = item.partition("=")
        if not sep or precision not in PRECISIONS or not Path(path).exists():
            raise SystemExit(f"--{what} {item!r}: write PRECISION=PATH with PRECISION one of {', '.join(PRECISIONS)} "
                             "and a path that exists")
        out[precision] = Path(path)
    return out


def _dims(export: Path) -> tuple[Path, dict]:
    from prunus.runtime.artifact import export_dims

    config = json.loads((export / "config.json").read_text())["export"]
    dims = export_dims(export, config)
    keys = ("n_layers", "n_kv_heads", "head_dim", "vocab_size")
    return export / config["graphs"]["model"], {k: dims[k] for k in keys}


def native_runner(export: Path, tokens: int, threads: int):
    from prunus.native.decoder import NativeDecoder
    from prunus.native.weights import native_weights_file, read_native_weights

    _, dims = _dims(export)
    packed = read_native_weights(native_weights_file(export), dims)
    shape = (1, dims["n_kv_heads"], tokens, dims["head_dim"])
    k, v = ([np.zeros(shape, np.float32) for _ in range(dims["n_layers"])] for _ in range(2))
    dec = NativeDecoder(packed, k, v, 1, tokens, threads)
    logits = np.zeros((1, dims["vocab_size"]), np.float32)

    def run(ids: np.ndarray) -> float:
        t0 = time.perf_counter()
        dec.forward(ids[None], np.zeros(1, np.int32), np.full(1, len(ids), np.int32), 0, logits)
        return time.perf_counter() - t0
    return run, dec.close


def ort_runner(export: Path, tokens: int, threads: int):
    from prunus.runtime.genai_session import GenaiSession

    graph, dims = _dims(export)
    sess = GenaiSession(graph, **dims, n_slots=1, max_len=tokens, threads=threads)

    def run(ids: np.ndarray) -> float:
        t0 = time.perf_counter()
        sess.prefill(0, [ids.tolist()])
        return time.perf_counter() - t0
    return run, sess.close


def llamacpp_runner(peer, gguf: Path, precision: str, tokens: int, threads: int):
    name = f"{precision}-{threads}"
    peer.load(name, gguf, tokens + 8)

    def run(ids: np.ndarray) -> float:
        return peer.generate(name, [ids.tolist()], 1, threads, 1)["ttft"]
    return run, lambda: None


def measure(runners: dict, ids: np.ndarray, rounds: int) -> dict[str, list[float]]:
    for run in runners.values():  # warm-up: first-pass allocations and page faults stay out of the figures
        run(ids)
    out = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            time.sleep(SETTLE_S)
            out[name].append(run(ids))
    return out


def cell(v: list[float] | None) -> str:
    if not v:
        return "-"
    return f"{statistics.median(v) * 1e3:7.1f} ms ({min(v) * 1e3:.0f}-{max(v) * 1e3:.0f})"


def ratio(a: list[float] | None, b: list[float] | None) -> str:
    return f"{statistics.median(a) / statistics.median(b):.2f}x" if a and b else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", action="append", default=[], help="PRECISION=genai export dir (repeat)")
    ap.add_argument("--gguf", action="append", default=[], help="PRECISION=GGUF file for llama.cpp (repeat)")
    ap.add_argument("--llamacpp-python", help="an interpreter that imports llama_cpp (skipped without one)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--no-onnxruntime", action="store_true", help="native and llama.cpp only")
    args = ap.parse_args()
    exports, ggufs = _pairs(args.export, "export"), _pairs(args.gguf, "gguf")
    if not exports:
        raise SystemExit("give at least one --export PRECISION=DIR")
    peer = None
    if ggufs and args.llamacpp_python:
        from benchmarks._llamacpp_peer import LlamaCppPeer, peer_python

        python, why = peer_python(args.llamacpp_python)
        peer = LlamaCppPeer(python) if python else print(f"llama.cpp skipped: {why}")
    ids = np.random.default_rng(0).integers(100, 20000, args.tokens).astype(np.int64)
    print(f"first token of a {args.tokens}-token prompt, batch 1, median (range) of {args.rounds} alternating rounds")
    print(f"CPU: {cpu_model()}; load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'precision':9s} {'threads':>7s} {'native':>24s} {'onnxruntime':>24s} {'llama.cpp':>24s}  "
          "native/ort  native/llama.cpp")
    try:
        for precision, export in exports.items():
            for threads in args.threads:
                runners, closers = {}, []
                makers = {"native": lambda: native_runner(export, args.tokens, threads)}
                if not args.no_onnxruntime:
                    makers["onnxruntime"] = lambda: ort_runner(export, args.tokens, threads)
                if peer is not None and precision in ggufs:
                    makers["llama.cpp"] = lambda: llamacpp_runner(peer, ggufs[precision], precision, args.tokens,
                                                                  threads)
                for name, make in makers.items():
                    runners[name], close = make()
                    closers.append(close)
                t = measure(runners, ids, args.rounds)
                for close in closers:
                    close()
                n, o, ll = t.get("native"), t.get("onnxruntime"), t.get("llama.cpp")
                print(f"{precision:9s} {threads:7d} {cell(n):>24s} {cell(o):>24s} {cell(ll):>24s}  "
                      f"{ratio(n, o):>10s}  {ratio(n, ll):>16s}", flush=True)
    finally:
        if peer is not None:
            peer.close()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
