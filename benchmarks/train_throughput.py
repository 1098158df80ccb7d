"""Training throughput: prunus's trainer beside a minimal hand-written torch loop.

Same model (the ``small`` preset unless --preset), same initial weights, same
batches, same optimizer settings; both time only the optimizer step (forward,
backward, clip, AdamW), with batches prepared off the clock. Prints the median
tokens/s of each and the ratio prunus / hand-written (goal >= 0.95).

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.train_throughput [--steps 30] [--rounds 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

from benchmarks._baseline import hand_written_loop
from benchmarks.harness import alternating_rounds, machine_line, ratio_line, write_results

from prunus.data import load_corpus
from prunus.models import ByteTokenizer
from prunus.train_parallel import TrainConfig, read_metrics, train


def prunus_trainer(cfg: TrainConfig) -> list[float]:
    with tempfile.TemporaryDirectory() as d:
        cfg.out = d + "/run"
        train(cfg)
        return [r["tokens_per_s"] for r in read_metrics(cfg.out)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="alternate the two this many times")
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the median")
    ap.add_argument("--json", metavar="PATH", help="also write the settings, machine and per-step figures here")
    args = ap.parse_args()
    cfg = TrainConfig(preset=args.preset, steps=args.steps, batch_size=args.batch_size, warmup_steps=5,
                      eval_every=10**9, eval_tokens=4096, ckpt_every=0, progress=False, max_corpus_bytes=4 << 20)
    corpus = load_corpus(None, ByteTokenizer(), max_bytes=cfg.max_corpus_bytes)
    got = alternating_rounds({"hand-written": lambda: hand_written_loop(cfg, corpus.train)["tokens_per_s"][args.skip:],
                              "prunus": lambda: prunus_trainer(TrainConfig(**cfg.to_dict()))[args.skip:]}, args.rounds)
    print(machine_line())
    print(f"model: {args.preset} ({cfg.model_config().num_params():,} params), batch {cfg.batch_size} x seq "
          f"{cfg.resolved_seq_len()}, {args.steps} steps x {args.rounds} rounds, median of steps after {args.skip}")
    print(ratio_line("prunus", got["prunus"], "hand-written", got["hand-written"], "tokens/s", "goal >= 0.95"))
    if args.json:
        print(f"results: {write_results(args.json, vars(args), {'tokens_per_s': got})}")


if __name__ == "__main__":
    sys.exit(main())
