"""Automatic prefix caching: time to the first token of a burst of requests that share a long system prompt.

``--requests`` (32) requests, each a ``--system-tokens`` (512) token system prompt followed by its own question,
are submitted at once to an Engine of ``--max-batch`` (8) rows, with and without ``prefix_cache_mb``; the cache is
emptied before each burst, so the first rows of a burst prefill the whole system prompt either way and the rest
find it cached. Prints each engine's mean time to first token and wall time per burst (median and range over
alternating rounds), the ratio, and the cache's counts. The model is SmolLM2-135M (``/tmp/smol/model-dir`` or
``--model``), else a random model of its shape, on the torch backend; ``--export DIR`` serves a genai export dir
(e.g. ``/tmp/smol/int8-genai``) on the ONNX Runtime backend instead (``--native``: decode in prunus's own kernels).
Timings never fail the run.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.prefix_cache [--model DIR | --export DIR [--native]] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)


def burst(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(mean seconds to the first token, seconds for the whole burst)."""
    prefix = getattr(engine.backend, "prefix", None)
    if prefix is not None:
        prefix.clear()
    t0 = time.perf_counter()
    results = engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    wall = time.perf_counter() - t0
    return statistics.mean(r.time_to_first_token_s for r in results), wall


def main() -> None:
    from benchmarks.harness import alternating_rounds, machine_line, median_range, median_ratio

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a prunus model dir (default: /tmp/smol/model-dir)")
    ap.add_argument("--export", default=None, help="a genai export dir, served on the ONNX Runtime backend")
    ap.add_argument("--native", action="store_true", help="with --export: decode in prunus's own kernels")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-mb", type=float, default=256.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    from benchmarks._smol_dir import smol_model_dir, text_ids
    from prunus.serve import Engine

    common = dict(max_batch=args.max_batch, max_len=args.system_tokens + 64 + args.new_tokens, threads=args.threads,
                  compile=False)
    if args.export:
        path, what = args.export, f"{args.export} (ONNX Runtime genai{', native decoding' if args.native else ''})"
        common["native"] = args.native
    else:
        path, what = smol_model_dir(args.model)
    plain = Engine.load(path, **common)
    cached = Engine.load(path, prefix_cache_mb=args.cache_mb, **common)
    system = text_ids(plain.tokenizer, args.system_tokens)
    prompts = [system + plain.encode(f"\nQuestion {i}: what does line {7 * i} of this file do?\nAnswer:")
               for i in range(args.requests)]
    print(machine_line())
    print(f"model: {what}; {args.requests} requests at once, a {args.system_tokens}-token system prompt each, "
          f"max batch {args.max_batch}, {args.threads} thread(s) per pass, {args.new_tokens} new tokens")
    got = alternating_rounds({"no cache": lambda: [burst(plain, prompts, args.new_tokens)],
                              "prefix cache": lambda: [burst(cached, prompts, args.new_tokens)]}, args.rounds)
    for name, runs in got.items():
        print(f"{name + ':':14s} mean time to first token {median_range([r[0] for r in runs], '.2f')} s, "
              f"burst {median_range([r[1] for r in runs], '.2f')} s")
    ttft = {k: [r[0] for r in v] for k, v in got.items()}
    print(f"ratio of mean time to first token, no cache / prefix cache: {median_ratio(ttft['no cache'], ttft['prefix cache'], '.2f')}")
    stats = cached.info["prefix_cache"]
    print(f"prefix cache (all rounds): {stats['hits']} of {stats['lookups']} prompts started from cached blocks, "
          f"{stats['reused_tokens']} of {stats['prompt_tokens']} prompt tokens reused, {stats['blocks']} blocks held")
    plain.close()
    cached.close()


if __name__ == "__main__":
    main()
