"""The native decoder's KV cache in float32 against float16, in one run: decode step time at a long position.

On a genai export (SmolLM2-135M int8, say), the same packed weights decode from position ``--position`` (and from
a short one, 16, for comparison) over a float32 cache and over a float16 one (``kv_dtype="f16"``: keys and values
widened from halves by F16C as attention reads them). The cache holds random keys and values up to the position
(the step's work does not depend on them; filling 2000 positions by a real prompt would only take longer). Each
figure is the median step of ``--steps`` steps; rounds alternate the two caches. Timings never fail the run.

    python -m benchmarks.native_kv_cache EXPORT_DIR [--position 2000] [--threads 2] [--batch 1] [--rounds 6] \
        [--gguf Q8_0.gguf --llamacpp-python PYTHON]

``--gguf``: llama.cpp beside them on a GGUF file of the same weights (its own float16 cache), in its own process
through its C API (``_llamacpp_worker.py``, its default thread policy): a prompt of ``position`` token ids in one
batch, then ``--steps`` greedy steps at batch 1; its step time is the steps' time after the first token over their
count (the steps run from the position on, as the native ones do).

``--random-smollm2`` in place of EXPORT_DIR: random int8 weights of SmolLM2-135M's shapes (30 layers, 576 wide,
9 query and 3 KV heads of 64, feed-forward 1536, 49152 tokens, the tied head in fp32), packed in memory by numpy
alone: the same work per step, for a machine without the export (or without torch).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import numpy as np

from benchmarks.harness import alternating_rounds, machine_line, median_range, median_ratio


def random_smollm2(max_len: int):
    """SmolLM2-135M's shapes with random int8 weights (zero points at the midpoint), packed."""
    from prunus.native.weights import PackedModel, pack_blocks, pack_f32

    rng = np.random.default_rng(0)
    dims = {"n_layers": 30, "n_heads": 9, "n_kv_heads": 3, "head_dim": 64, "hidden": 1536, "vocab_size": 49152}
    dim, hd = 576, 64

    def int8(n, k):
        return pack_blocks(rng.integers(0, 256, (n, k)).astype(np.uint8),
                           rng.uniform(1e-3, 1e-2, (n, k // 32)).astype(np.float32), None, 8)

    angles = np.outer(np.arange(max_len), 1e5 ** (-np.arange(hd // 2) / (hd // 2))).astype(np.float32)
    emb = (0.02 * rng.standard_normal((dims["vocab_size"], dim))).astype(np.float32)
    model = PackedModel(dims, 1e-5, hd ** -0.5, emb, np.cos(angles), np.sin(angles), np.ones(dim, np.float32))
    for _ in range(dims["n_layers"]):
        model.layers.append({"q": int8(9 * hd, dim), "k": int8(3 * hd, dim), "v": int8(3 * hd, dim),
                             "o": int8(dim, 9 * hd), "gate": int8(1536, dim), "up": int8(1536, dim),
                             "down": int8(dim, 1536), "attn_norm": np.ones(dim, np.float32),
                             "ffn_norm": np.ones(dim, np.float32), "window": 0})
    model.head = pack_f32(emb)
    return model, dims


def decoder(export: Path | None, kv_dtype: str, batch: int, max_len: int, threads: int):
    """A native decoder over the export's weights (None: random SmolLM2-shaped ones) and a cache of random keys and
    values of ``kv_dtype``."""
    from prunus.native.decoder import KV_DTYPES, NativeDecoder

    if export is None:
        packed, dims = random_smollm2(max_len)
    else:
        from prunus.native.weights import native_weights_file, read_native_weights
        from prunus.runtime.artifact import export_dims

        dims = export_dims(export, json.loads((export / "config.json").read_text())["export"])
        packed = read_native_weights(native_weights_file(export), dims)
    rng = np.random.default_rng(0)
    shape = (batch, dims["n_kv_heads"], max_len, dims["head_dim"])
    kv = [rng.standard_normal(shape, np.float32).astype(KV_DTYPES[kv_dtype]) for _ in range(2 * dims["n_layers"])]
    return NativeDecoder(packed, kv[::2], kv[1::2], batch, max_len, threads), dims


def step_ms(dec, dims, batch: int, position: int, steps: int) -> float:
    """The median of ``steps`` decode steps from ``position`` (every row at it), in ms."""
    logits = np.zeros((batch, dims["vocab_size"]), np.float32)
    ids = np.full((batch, 1), 42, np.int64)
    times = []
    for i in range(steps):
        start = time.perf_counter()
        dec.forward(ids, np.full(batch, position + i, np.int32), np.ones(batch, np.int32), 0, logits)
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def llamacpp_step_ms(peer, position: int, steps: int, threads: int, vocab: int) -> float:
    """llama.cpp's mean decode step (ms) after a prompt of ``position`` ids, over ``steps`` steps."""
    prompt = [(7 * i) % (vocab - 10) + 5 for i in range(position)]
    r = peer.generate("peer", [prompt], steps + 1, threads, 1)
    return 1e3 * (r["seconds"] - r["ttft"]) / steps


def _contenders(args, decoders: dict, peer, vocab: int, position: int) -> dict:
    fns = {dt: (lambda d=d: step_ms(*d, args.batch, position, args.steps)) for dt, d in decoders.items()}
    if peer is not None:
        fns["llama.cpp"] = lambda: llamacpp_step_ms(peer, position, args.steps, args.threads, vocab)
    return fns


def _peer(args, max_len: int):
    """The llama.cpp worker with ``--gguf`` loaded, or None (without --gguf, or with the reason printed)."""
    if args.gguf is None:
        return None
    from benchmarks._llamacpp_peer import LlamaCppPeer, peer_python

    python, why = peer_python(args.llamacpp_python)
    if python is None:
        print(f"llama.cpp skipped: {why}")
        return None
    peer = LlamaCppPeer(python)
    peer.load("peer", args.gguf, max_len + 8)
    return peer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path, nargs="?", help="a genai export dir (with native_weights.safetensors)")
    ap.add_argument("--random-smollm2", action="store_true", help="random weights of SmolLM2-135M's shapes instead")
    ap.add_argument("--position", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--gguf", type=Path, default=None, help="llama.cpp beside them on this GGUF file")
    ap.add_argument("--llamacpp-python", default=None, help="an interpreter that imports llama_cpp")
    args = ap.parse_args()
    if (args.export is None) == (not args.random_smollm2):
        ap.error("give an export dir or --random-smollm2 (one of them)")
    from prunus.native.build import isa

    max_len = args.position + args.steps + 1
    decoders = {dt: decoder(args.export, dt, args.batch, max_len, args.threads) for dt in ("f32", "f16")}
    print(machine_line())
    print(f"{args.export or 'random SmolLM2-135M-shaped int8'}: kernel path {isa()}, {args.threads} threads, "
          f"batch {args.batch}, median step of "
          f"{args.steps}, {args.rounds} alternating rounds")
    peer = _peer(args, max_len)
    if peer is not None and args.batch != 1:
        ap.error("llama.cpp is timed at batch 1: drop --batch or --gguf")
    vocab = decoders["f32"][1]["vocab_size"]
    try:
        for position in (16, args.position):
            got = alternating_rounds(_contenders(args, decoders, peer, vocab, position), args.rounds)
            print(f"position {position}: f32 cache {median_range(got['f32'], '.2f')} ms, "
                  f"f16 cache {median_range(got['f16'], '.2f')} ms"
                  + (f", llama.cpp {median_range(got['llama.cpp'], '.2f')} ms" if peer is not None else ""))
            print(f"  ratio f16 / f32: {median_ratio(got['f16'], got['f32'])}"
                  + (f"; native f16 / llama.cpp: {median_ratio(got['f16'], got['llama.cpp'])}" if peer else ""))
    finally:
        for dec, _ in decoders.values():
            dec.close()
        if peer is not None:
            peer.close()


if __name__ == "__main__":
    main()
