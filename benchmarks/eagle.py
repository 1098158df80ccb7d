"""EAGLE speculative decoding at batch 1 beside plain decoding and prompt lookup, on one runtime, in one run.

The target is a genai export served by the native kernels (``--target``, e.g. an int8 export of SmolLM2-135M) or a
model dir on torch; the draft an EAGLE draft dir trained for it (``prunus compress MODEL --distill eagle``). For each
thread count (``--threads 1,2``) the contenders are Engines with one cache row, greedy, ``--new-tokens`` tokens after
each prompt, timed in alternating rounds:

* ``plain``: one decode pass per token;
* ``ngram kK``: prompt-lookup drafting (no model);
* ``eagle V kK``: the draft with its head cut to (or widened to) the ``V`` most frequent tokens, ``--vocab``: the
  trained block with the target's head rows of the first ``V`` ids of its frequency ranking (the trained draft's
  own ranking continued by the target's remaining ids, in id order), at most ``K`` drafted tokens per step (each row
  its own k, plain decoding where speculation measured slower; ``--fixed``: K at every step).

Prompts: English prose (the first held-out topic of ``pydoc_data.topics``) and Python code (Python's ``json``
package source), both text that ``benchmarks/draft_corpus.py`` leaves out of a draft's training corpus. Prints each
contender's decode tokens/s (median and range), acceptance, tokens per step, the draft's time per drafted token over
the target's per plain token (measured inside the runs), whether its tokens equal plain decoding's, and the ratio to
plain. ``--plot`` writes speedup against the draft vocabulary. Timings never fail the run.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.eagle --target EXPORT_DIR --draft DRAFT_DIR --model MODEL_DIR
        [--vocab 4096,16384,49152] [--draft-tokens 3] [--threads 1,2] [--new-tokens 96] [--rounds 2]
        [--prompt-chars 1500] [--plot eagle.png] [--fixed]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)


def resized_draft(draft: Path, model: Path, vocab: int, out: Path) -> Path:
    """The draft at ``draft`` with its head over the first ``vocab`` ids of its ranking (continued by the target's
    other ids in id order), the target's own head rows; saved as a draft dir of the target ``model``."""
    import torch

    from prunus.models import load_model, load_model_tokenizer
    from prunus.models.eagle_draft import EagleDraft, load_eagle_draft, save_eagle_draft

    trained, config = load_eagle_draft(draft)
    target = load_model(model)
    seen = set(trained.token_ids.tolist())
    ranking = trained.token_ids.tolist() + [i for i in range(target.config.vocab_size) if i not in seen]
    ids = torch.tensor(ranking[:vocab])
    resized = EagleDraft(target.config, vocab)
    state = {k: v for k, v in trained.state_dict().items() if k not in ("head.weight", "token_ids")}
    resized.load_state_dict({**state, "head.weight": target.output.weight[ids].detach(), "token_ids": ids})
    record = {k: v for k, v in config["eagle"].items() if k not in ("vocab", "target_vocab", "hidden", "target_hash")}
    return save_eagle_draft(resized, out, target=model, tokenizer=load_model_tokenizer(model),
                            record={**record, "resized_from": str(draft)}, metrics={}, command="benchmarks.eagle")


class Timed:
    """Wraps a drafter's ``propose``: seconds spent drafting and tokens drafted."""

    def __init__(self, drafter):
        self.drafter, self.seconds, self.tokens = drafter, 0.0, 0
        self.inner = drafter.propose
        drafter.propose = self

    def __call__(self, *args):
        t = time.perf_counter()
        drafts, q = self.inner(*args)
        self.seconds += time.perf_counter() - t
        self.tokens += len(drafts)
        return drafts, q


def prompts(chars: int) -> dict[str, str]:
    import inspect
    import json

    from prunus.data.prose import prose_documents

    return {"prose": prose_documents()[1][0].decode("utf-8")[:chars], "code": inspect.getsource(json)[:chars]}


def engines_for(target: Path, drafts: dict[int, Path], ks: list[int], threads: int, fixed: bool) -> dict:
    from prunus.serve import Engine

    common = dict(max_batch=1, max_len=None, threads=threads)
    engines = {"plain": Engine.load(target, **common)}
    engines[f"ngram k{ks[-1]}"] = Engine.load(target, draft="ngram", draft_tokens=ks[-1], **common)
    for vocab, d in drafts.items():
        for k in ks:
            engines[f"eagle {vocab} k{k}"] = Engine.load(target, draft=d, draft_tokens=k, **common)
    for e in engines.values():
        if e.speculator is not None:
            e.speculator.adaptive = not fixed  # fixed: every step drafts k tokens, whatever it measures
    return engines


def measure(engines: dict, prompt: str, new_tokens: int, rounds: int) -> dict:
    """{contender: figures} for one prompt: tokens/s of each round, acceptance, tokens per step, draft cost."""
    from benchmarks.harness import alternating_rounds

    tokens: dict[str, list[int]] = {}
    before = {k: dict(e.info.get("speculative", {})) for k, e in engines.items()}
    timers = {k: Timed(e.speculator.drafter) for k, e in engines.items() if k.startswith("eagle")}
    for t in timers.values():
        t.seconds, t.tokens = 0.0, 0

    def contender(name):
        def go():
            r = engines[name].generate(prompt, max_new_tokens=new_tokens, ignore_eos=True)
            tokens[name] = r.token_ids
            return r.decode_tokens_per_s
        return go

    got = alternating_rounds({k: contender(k) for k in engines}, rounds)
    out = {}
    for name, speeds in got.items():
        fig = {"speeds": speeds, "same": tokens[name] == tokens["plain"]}
        if name != "plain":
            s, b = engines[name].info["speculative"], before[name]
            drafted, accepted = s["drafted"] - b.get("drafted", 0), s["accepted"] - b.get("accepted", 0)
            steps = s["steps"] - b.get("steps", 0)
            fig.update(acceptance=accepted / drafted if drafted else 0.0,
                       per_step=(accepted + steps) / steps if steps else 0.0)
        if name in timers and timers[name].tokens:
            fig["draft_s_per_token"] = timers[name].seconds / timers[name].tokens
        out[name] = fig
    for t in timers.values():
        t.drafter.propose = t.inner
    return out


def report(label: str, n_prompt: int, figures: dict) -> None:
    from statistics import median

    from benchmarks.harness import median_range

    plain = median(figures["plain"]["speeds"])
    width = max(map(len, figures))
    print(f"\nprompt: {label} ({n_prompt} tokens)")
    for name, f in figures.items():
        line = f"  {name:{width}s} {median_range(f['speeds'], '.1f')} tokens/s"
        if name != "plain":
            line += (f", acceptance {f['acceptance']:.2f}, {f['per_step']:.2f} tokens per step, same tokens as plain: "
                     f"{'yes' if f['same'] else 'no'}, ratio to plain {median(f['speeds']) / plain:.2f}")
        if "draft_s_per_token" in f:
            line += f", draft cost per token {f['draft_s_per_token'] * plain:.2f} of the target's"
        print(line)


def plot(results: dict, path: str, k: int, fixed: bool = False) -> None:
    """Speedup over plain decoding against the draft vocabulary, a line per (threads, prompt)."""
    from statistics import median

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (threads, label), figures in results.items():
        plain = median(figures["plain"]["speeds"])
        points = sorted((int(n.split()[1]), median(f["speeds"]) / plain) for n, f in figures.items()
                        if n.startswith("eagle") and n.endswith(f" k{k}"))
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{label}, {threads} thread(s)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft head vocabulary (most frequent tokens)")
    ax.set_ylabel("decode tokens/s over plain decoding")
    ax.set_title(f"EAGLE draft, {'' if fixed else 'at most '}{k} drafted tokens per step, batch 1, greedy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from benchmarks.harness import machine_line

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="a genai export dir (native kernels) or a model dir (torch)")
    ap.add_argument("--draft", required=True, help="an EAGLE draft dir trained for the target")
    ap.add_argument("--model", required=True, help="the target's model dir (its head rows for resized drafts)")
    ap.add_argument("--vocab", default="", help="draft head sizes to compare, e.g. 4096,16384,49152 (default: the draft's)")
    ap.add_argument("--draft-tokens", default="3", help="drafted tokens per step, one value or several: 2,3")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-chars", type=int, default=1500, help="characters of each prompt")
    ap.add_argument("--plot", default=None, help="write speedup against vocabulary to this PNG")
    ap.add_argument("--fixed", action="store_true", help="draft k tokens at every step (no per-row choice of k, "
                    "no switching off where speculation loses)")
    args = ap.parse_args()
    from prunus.models.eagle_draft import load_eagle_draft

    trained = load_eagle_draft(args.draft)[1]["eagle"]
    tmp = Path(tempfile.mkdtemp(prefix="prunus-eagle-"))
    vocabs = [int(v) for v in args.vocab.split(",")] if args.vocab else [trained["vocab"]]
    drafts = {v: Path(args.draft) if v == trained["vocab"] else resized_draft(Path(args.draft), Path(args.model), v,
                                                                               tmp / f"draft-{v}") for v in vocabs}
    ks = [int(k) for k in args.draft_tokens.split(",")]
    print(machine_line())
    print(f"target: {args.target}\ndraft: {args.draft} (trained over {trained['vocab']} tokens, {trained['steps']} "
          f"steps x {trained['batch_size']} x {trained['seq_len']} tokens of {trained['corpus']})\nbatch 1, greedy, "
          f"{args.new_tokens} new tokens, drafted tokens per step {args.draft_tokens}"
          f"{' (fixed)' if args.fixed else ' at most (each row its own k; plain where speculation loses)'}")
    results = {}
    for threads in (int(t) for t in args.threads.split(",")):
        engines = engines_for(Path(args.target), drafts, ks, threads, args.fixed)
        print(f"\n== {threads} thread(s) per pass, runtime {engines['plain'].info['runtime']}")
        for label, prompt in prompts(args.prompt_chars).items():
            results[(threads, label)] = figures = measure(engines, prompt, args.new_tokens, args.rounds)
            report(label, len(engines["plain"].encode(prompt)), figures)
        for e in engines.values():
            e.close()
    if args.plot:
        plot(results, args.plot, ks[-1], args.fixed)
        print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
