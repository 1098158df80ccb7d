"""Speculative decoding at batch 1: decode tokens/s of plain decoding beside speculative decoding, in one run.

The target is SmolLM2-135M (``/tmp/smol/model-dir`` or ``--model``; else a random model of its shape). Contenders,
each an Engine with one cache row and ``--threads`` threads per pass, greedy, ``--new-tokens`` tokens after each
prompt, in alternating rounds:

* ``plain``: one decode pass per token;
* ``ngram``: prompt-lookup drafting (``draft="ngram"``), ``--draft-tokens`` per step;
* ``draft``: a draft model dir, ``--draft DIR``, or by default a stand-in made here: the target's first
  ``--draft-layers`` blocks with its final norm and head (no training: a truncated copy, not a distilled student).

Prompts: a repetitive code-like one (a table of similar functions) and a piece of Python's own ``json`` source.
Prints each contender's decode tokens/s (median and range), its acceptance rate and tokens per step, whether its
tokens equal plain decoding's, and the ratio to plain. Timings never fail the run; losses are printed as they are.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.speculative [--model DIR] [--draft DIR] [--threads 1] [--rounds 2]
"""

from __future__ import annotations

if not __package__:  # run as a file (python benchmarks/NAME.py), not with -m
    import _bootstrap  # noqa: F401  (puts the repository root on the import path)

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPETITIVE = "".join(f"def get_{name}(record):\n    \"\"\"The record's {name}.\"\"\"\n    return record[\"{name}\"]\n\n\n"
                     for name in ("id", "name", "email", "address", "phone", "city")) + "def get_"


def truncated_draft(target: Path, layers: int) -> Path:
    """The target's first ``layers`` blocks, its final norm and head, saved as a model dir with its tokenizer."""
    from dataclasses import replace

    import torch

    from prunus.models import Transformer, load_model, load_model_tokenizer, save_model

    model = load_model(target)
    small = Transformer(replace(model.config, n_layers=layers))
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("layers.") or int(k.split(".")[1]) < layers}
    small.load_state_dict(state, strict=False)
    out = Path(tempfile.mkdtemp(prefix="prunus-draft-")) / "draft"
    with torch.no_grad():
        return save_model(small.eval(), out, tokenizer=load_model_tokenizer(target), stage="benchmark")


def run(engine, prompt: str, new_tokens: int) -> tuple[float, list[int]]:
    r = engine.generate(prompt, max_new_tokens=new_tokens, ignore_eos=True)
    return r.decode_tokens_per_s, r.token_ids


def main() -> None:
    import inspect
    import json

    from benchmarks._smol_dir import smol_model_dir
    from benchmarks.harness import alternating_rounds, machine_line, median_range, median_ratio
    from prunus.serve import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a prunus model dir (default: /tmp/smol/model-dir)")
    ap.add_argument("--draft", default=None, help="a draft model dir (default: a truncated copy of the target)")
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    target, what = smol_model_dir(args.model)
    draft = Path(args.draft) if args.draft else truncated_draft(target, args.draft_layers)
    draft_what = args.draft or f"the target's first {args.draft_layers} blocks, untrained (a stand-in draft)"
    common = dict(max_batch=1, max_len=2048, threads=args.threads, compile=False)
    engines = {"plain": Engine.load(target, **common),
               "ngram": Engine.load(target, draft="ngram", draft_tokens=args.draft_tokens, **common),
               "draft": Engine.load(target, draft=draft, draft_tokens=args.draft_tokens, **common)}
    prompts = {"repetitive code": REPETITIVE, "json source": inspect.getsource(json)[:1500]}
    print(machine_line())
    print(f"target: {what}; draft: {draft_what}; batch 1, greedy, {args.new_tokens} new tokens, {args.draft_tokens} "
          f"draft tokens per step, {args.threads} thread(s) per pass")
    for label, prompt in prompts.items():
        tokens: dict[str, list[int]] = {}
        before = {k: dict(e.info.get("speculative", {})) for k, e in engines.items()}

        def contender(name):
            def go():
                speed, ids = run(engines[name], prompt, args.new_tokens)
                tokens[name] = ids
                return speed
            return go

        got = alternating_rounds({k: contender(k) for k in engines}, args.rounds)
        print(f"\nprompt: {label} ({len(engines['plain'].encode(prompt))} tokens)")
        for name, speeds in got.items():
            line = f"  {name:6s} {median_range(speeds, '.1f')} tokens/s"
            if name != "plain":
                s, b = engines[name].info["speculative"], before[name]
                drafted, accepted = s["drafted"] - b.get("drafted", 0), s["accepted"] - b.get("accepted", 0)
                steps = s["steps"] - b.get("steps", 0)
                line += (f", acceptance {accepted / drafted if drafted else 0:.2f}, "
                         f"{(accepted + steps) / steps if steps else 0:.2f} tokens per step, "
                         f"same tokens as plain: {'yes' if tokens[name] == tokens['plain'] else 'no'}, "
                         f"ratio to plain {median_ratio(speeds, got['plain'], '.2f')}")
            print(line)
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
