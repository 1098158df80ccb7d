"""EAGLE speculative decoding beside plain decoding and prompt lookup, on one runtime, in one run.

The target is a genai export served by the native kernels (``--target``, e.g. an int8 export of SmolLM2-135M) or a
model dir on torch; the draft an EAGLE draft dir trained for it (``prunus compress MODEL --distill eagle``). For each
thread count (``--threads 1,2``) the contenders are Engines with one cache row (``--batch N``: N rows, N requests at
once, each half of the prompt text starting further into it; tokens/s is then their new tokens over the batch's wall
time, prefill included), greedy, ``--new-tokens`` tokens after each prompt, timed in alternating rounds after one
untimed call of each:

* ``plain``: one decode pass per token;
* ``ngram kK``: prompt-lookup drafting (no model);
* ``eagle+ngram V kK``: the same draft and prompt lookup as two sources, each step of a row drafting from the one
  likelier to pay (``--speculative DIR+ngram``); its draft cost counts the EAGLE drafts only;
* ``eagle V kK``: the draft with its head cut to (or widened to) the ``V`` most frequent tokens, ``--vocab``: the
  trained block with the target's head rows of the first ``V`` ids of its frequency ranking (the trained draft's
  own ranking continued by the target's remaining ids, in id order), at most ``K`` drafted tokens per step (each row
  its own k, plain decoding where speculation measured slower; ``--fixed``: K at every step).

Prompts: English prose (the first held-out topic of ``pydoc_data.topics``) and Python code (Python's ``json``
package source), both text that ``benchmarks/draft_corpus.py`` leaves out of a draft's training corpus. Prints each
contender's decode tokens/s (median and range), acceptance, tokens per step, the draft's time per drafted token over
the target's per plain token (measured inside the runs), whether its tokens equal plain decoding's, and the ratio to
plain. ``--plot`` writes speedup against the draft vocabulary. Timings never fail the run.

``--llamacpp-python PY --gguf FILE`` adds llama.cpp's own decoding of the same prompt tokens, on a GGUF of the same
target weights (Q8_0 beside an int8 export, F32 beside an fp32 one), in a worker process run by ``PY`` (an interpreter
with llama-cpp-python, ``benchmarks/_llamacpp_worker.py``), alternating with the contenders above:

* ``llama.cpp plain``: llama-cpp-python's ``Llama.generate``, greedy;
* ``llama.cpp lookup kK``: the same with its own prompt lookup, ``LlamaPromptLookupDecoding(num_pred_tokens=K)``
  as the ``Llama``'s draft model (K: the largest ``--draft-tokens``).

Both are timed as prunus's ``decode_tokens_per_s`` is: the tokens after the first over the seconds from the first
new token out (prefill done) to the last. Each row prints how many leading tokens equal prunus plain's (and, for
lookup, llama.cpp plain's), the lookup/plain ratio and the ratio to prunus plain.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.eagle --target EXPORT_DIR --draft DRAFT_DIR --model MODEL_DIR
        [--vocab 4096,16384,49152] [--draft-tokens 3] [--threads 1,2] [--new-tokens 96] [--rounds 2]
        [--prompt-chars 1500] [--batch 1] [--plot eagle.png] [--fixed] [--llamacpp-python PY --gguf FILE]
"""

from __future__ import annotations

import argparse
import copy
import sys
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


class LlamaCppRows:
    """llama.cpp's own greedy decoding on ``gguf`` in the peer worker: plain, and speculating with llama-cpp-python's
    prompt lookup (``k`` drafted tokens a step). ``contenders`` gives timed calls for ``measure``; ``tokens`` keeps
    each row's last tokens."""

    def __init__(self, python: str, gguf: Path, k: int):
        from benchmarks._llamacpp_peer import LlamaCppPeer

        self.peer, self.gguf, self.k = LlamaCppPeer(python), gguf, k
        self.names = {"llama.cpp plain": 0, f"llama.cpp lookup k{k}": k}
        self.version, self.n_ctx, self.tokens = self.peer.info()["version"], 0, {}

    def load(self, n_ctx: int) -> None:
        """Both rows' ``Llama`` with ``n_ctx`` positions (once; again only if a longer context is needed)."""
        if n_ctx > self.n_ctx:
            for name, k in self.names.items():
                self.peer.spec_load(name, self.gguf, n_ctx, k)
            self.n_ctx = n_ctx

    def contenders(self, ids: list[int], new_tokens: int, threads: int) -> dict:
        def row(name):
            def go():
                r = self.peer.spec_generate(name, ids, new_tokens, threads)
                self.tokens[name] = r["tokens"]
                return (len(r["tokens"]) - 1) / r["seconds"] if r["seconds"] > 0 else None
            return go
        return {name: row(name) for name in self.names}

    def close(self) -> None:
        self.peer.close()


def leading_equal(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share before they first differ."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prompts(chars: int) -> dict[str, str]:
    import inspect
    import json

    from prunus.data.prose import prose_documents

    return {"prose": prose_documents()[1][0].decode("utf-8")[:chars], "code": inspect.getsource(json)[:chars]}


def engines_for(target: Path, drafts: dict[int, Path], ks: list[int], threads: int, fixed: bool,
                batch: int = 1) -> dict:
    from prunus.serve import Engine

    common = dict(max_batch=batch, max_len=None, threads=threads)
    engines = {"plain": Engine.load(target, **common)}
    engines[f"ngram k{ks[-1]}"] = Engine.load(target, draft="ngram", draft_tokens=ks[-1], **common)
    for vocab, d in drafts.items():
        for k in ks:
            engines[f"eagle {vocab} k{k}"] = Engine.load(target, draft=d, draft_tokens=k, **common)
            engines[f"eagle+ngram {vocab} k{k}"] = Engine.load(target, draft=f"{d}+ngram", draft_tokens=k, **common)
    for e in engines.values():
        if e.speculator is not None:
            e.speculator.adaptive = not fixed  # fixed: every step drafts k tokens, whatever it measures
    return engines


def batch_of(prompt: str, batch: int) -> list[str]:
    """``batch`` different requests from one text: each starts further into it (the same length of text each)."""
    step = len(prompt) // (2 * batch)
    return [prompt[i * step:i * step + len(prompt) // 2] for i in range(batch)]


def measure(engines: dict, prompt: str, new_tokens: int, rounds: int, peer: dict | None = None,
            batch: int = 1) -> dict:
    """{contender: figures} for one prompt: tokens/s of each round, acceptance, tokens per step, draft cost;
    ``peer``: more contenders ({name: call giving tokens/s}, llama.cpp's), alternating with the engines. ``batch`` >
    1: that many requests at once (:func:`batch_of`), tokens/s their new tokens over the batch's wall time."""
    from benchmarks.harness import alternating_rounds

    tokens: dict[str, list[int]] = {}
    timers = {k: Timed(e.speculator.drafter.drafters[0]) for k, e in engines.items() if k.startswith("eagle")}

    def contender(name):
        def go():
            if batch > 1:
                t0 = time.perf_counter()
                rs = engines[name].generate(batch_of(prompt, batch), max_new_tokens=new_tokens, ignore_eos=True)
                tokens[name] = [r.token_ids for r in rs]
                return sum(len(r.token_ids) for r in rs) / (time.perf_counter() - t0)
            r = engines[name].generate(prompt, max_new_tokens=new_tokens, ignore_eos=True)
            tokens[name] = r.token_ids
            return r.decode_tokens_per_s
        return go

    contenders = {**{k: contender(k) for k in engines}, **(peer or {})}
    for go in contenders.values():  # one untimed call each first: the first round ran slower for every contender
        go()
    before = {k: copy.deepcopy(e.info.get("speculative", {})) for k, e in engines.items()}
    for t in timers.values():
        t.seconds, t.tokens = 0.0, 0
    got = alternating_rounds(contenders, rounds)
    out = {}
    for name, speeds in got.items():
        if name not in engines:
            out[name] = {"speeds": speeds}
            continue
        fig = {"speeds": speeds, "same": tokens[name] == tokens["plain"]}
        if name != "plain":
            s, b = engines[name].info["speculative"], before[name]
            drafted, accepted = s["drafted"] - b.get("drafted", 0), s["accepted"] - b.get("accepted", 0)
            steps = s["steps"] - b.get("steps", 0)
            fig.update(acceptance=accepted / drafted if drafted else 0.0,
                       per_step=(accepted + steps) / steps if steps else 0.0, sources=source_counts(s, b))
        if name in timers and timers[name].tokens:
            fig["draft_s_per_token"] = timers[name].seconds / timers[name].tokens
        out[name] = fig
    for t in timers.values():
        t.drafter.propose = t.inner
    out["plain"]["tokens"] = tokens["plain"]
    return out


def source_counts(now: dict, before: dict) -> dict:
    """{draft source: [drafted, accepted]} between two of a speculator's stats."""
    was = before.get("sources", {})
    return {src: [c[key] - was.get(src, {}).get(key, 0) for key in ("drafted", "accepted")]
            for src, c in now.get("sources", {}).items()}


def peer_figures(figures: dict, llama: LlamaCppRows) -> None:
    """Adds to llama.cpp's rows in ``figures`` how many leading tokens equal prunus plain's (and llama.cpp plain's)."""
    plain = figures["plain"]["tokens"]
    ref = llama.tokens.get("llama.cpp plain", [])
    for name in llama.names:
        got = llama.tokens.get(name, [])
        figures[name].update(equal=leading_equal(got, plain), n=len(got), equal_llama=leading_equal(got, ref))


def report(label: str, n_prompt: int, figures: dict) -> None:
    from statistics import median

    from benchmarks.harness import median_range

    plain = median(figures["plain"]["speeds"])
    width = max(map(len, figures))
    print(f"\nprompt: {label} ({n_prompt} tokens)")
    for name, f in figures.items():
        line = f"  {name:{width}s} {median_range(f['speeds'], '.1f')} tokens/s"
        if name.startswith("llama.cpp"):
            print(line + peer_line(name, f, figures, plain))
            continue
        if name != "plain":
            line += (f", acceptance {f['acceptance']:.2f}, {f['per_step']:.2f} tokens per step, same tokens as plain: "
                     f"{'yes' if f['same'] else 'no'}, ratio to plain {median(f['speeds']) / plain:.2f}")
        if "draft_s_per_token" in f:
            line += f", draft cost per token {f['draft_s_per_token'] * plain:.2f} of the target's"
        if len(f.get("sources", {})) > 1:
            line += ", drafted / accepted by source: " + ", ".join(
                f"{src} {d}/{a}" for src, (d, a) in sorted(f["sources"].items()) if d)
        print(line)


def peer_line(name: str, f: dict, figures: dict, plain: float) -> str:
    """The end of a llama.cpp row: tokens equal to prunus plain's, its ratio to llama.cpp plain and to prunus plain."""
    from statistics import median

    if not f["speeds"]:
        return ""
    line = f", first {f['equal']} of {f['n']} tokens equal to prunus plain's"
    mine = median(f["speeds"])
    lplain = figures.get("llama.cpp plain", {}).get("speeds")
    if name != "llama.cpp plain" and lplain:
        line += (f", first {f['equal_llama']} equal to llama.cpp plain's, lookup/plain ratio "
                 f"{mine / median(lplain):.2f}")
    return line + f", ratio to prunus plain {mine / plain:.2f}"


def plot(results: dict, path: str, k: int, fixed: bool = False, batch: int = 1) -> None:
    """Speedup over plain decoding against the draft vocabulary, a line per (threads, prompt)."""
    from statistics import median

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (threads, label), figures in results.items():
        plain = median(figures["plain"]["speeds"])
        points = sorted((int(n.split()[1]), median(f["speeds"]) / plain) for n, f in figures.items()
                        if n.startswith("eagle ") and n.endswith(f" k{k}"))
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{label}, {threads} thread(s)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft head vocabulary (most frequent tokens)")
    ax.set_ylabel("decode tokens/s over plain decoding")
    ax.set_title(f"EAGLE draft, {'' if fixed else 'at most '}{k} drafted tokens per step, batch {batch}, greedy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
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
    ap.add_argument("--batch", type=int, default=1, help="requests at once (continuous batching): tokens/s over the "
                    "batch's wall time, prefill included; each request half the prompt, starting further into it")
    ap.add_argument("--plot", default=None, help="write speedup against vocabulary to this PNG")
    ap.add_argument("--fixed", action="store_true", help="draft k tokens at every step (no per-row choice of k, "
                    "no switching off where speculation loses)")
    ap.add_argument("--llamacpp-python", default=None, help="an interpreter with llama-cpp-python: adds llama.cpp "
                    "plain and prompt-lookup rows (with --gguf)")
    ap.add_argument("--gguf", default=None, help="the GGUF of the target's weights llama.cpp runs (with "
                    "--llamacpp-python): Q8_0 beside an int8 export, F32 beside an fp32 one")
    return ap.parse_args()


def llama_rows(args: argparse.Namespace, k: int) -> LlamaCppRows | None:
    """The llama.cpp rows the options ask for, or None; a wrong combination or file ends the run in one line."""
    from benchmarks._llamacpp_peer import peer_python

    def fail(msg: str):
        print(f"benchmarks.eagle: {msg}", file=sys.stderr)
        raise SystemExit(2)

    if args.gguf is None and args.llamacpp_python is None:
        return None
    if args.gguf is None or args.llamacpp_python is None:
        fail("--gguf and --llamacpp-python go together: give the GGUF file llama.cpp runs and the interpreter that "
             "has llama-cpp-python, or neither")
    if not Path(args.gguf).is_file():
        fail(f"--gguf {args.gguf}: no such file; write one with prunus convert --to-gguf MODEL_DIR --out FILE")
    python, why = peer_python(args.llamacpp_python)
    if python is None:
        fail(why)
    return LlamaCppRows(python, Path(args.gguf), k)


def main() -> None:
    from benchmarks.harness import machine_line

    args = parse_args()
    ks = [int(k) for k in args.draft_tokens.split(",")]
    llama = llama_rows(args, ks[-1])
    from prunus.models.eagle_draft import load_eagle_draft

    trained = load_eagle_draft(args.draft)[1]["eagle"]
    tmp = Path(tempfile.mkdtemp(prefix="prunus-eagle-"))
    vocabs = [int(v) for v in args.vocab.split(",")] if args.vocab else [trained["vocab"]]
    drafts = {v: Path(args.draft) if v == trained["vocab"] else resized_draft(Path(args.draft), Path(args.model), v,
                                                                               tmp / f"draft-{v}") for v in vocabs}
    print(machine_line())
    print(f"target: {args.target}\ndraft: {args.draft} (trained over {trained['vocab']} tokens, {trained['steps']} "
          f"steps x {trained['batch_size']} x {trained['seq_len']} tokens of {trained['corpus']})\nbatch {args.batch}, "
          f"greedy, "
          f"{args.new_tokens} new tokens, drafted tokens per step {args.draft_tokens}"
          f"{' (fixed)' if args.fixed else ' at most (each row its own k; plain where speculation loses)'}")
    if llama is not None and args.batch > 1:
        raise SystemExit("benchmarks.eagle: llama.cpp's rows run batch 1; drop --batch or --llamacpp-python")
    if llama is not None:
        print(f"llama.cpp: llama-cpp-python {llama.version} on {llama.gguf}, Llama.generate greedy, plain and "
              f"LlamaPromptLookupDecoding(num_pred_tokens={llama.k})")
    try:
        results = run(args, drafts, ks, llama)
    finally:
        if llama is not None:
            llama.close()
    if args.plot:
        plot(results, args.plot, ks[-1], args.fixed, args.batch)
        print(f"\nwrote {args.plot}")


def run(args: argparse.Namespace, drafts: dict[int, Path], ks: list[int], llama: LlamaCppRows | None) -> dict:
    """{(threads, prompt label): figures}, each thread count's table printed as it is measured."""
    results = {}
    for threads in (int(t) for t in args.threads.split(",")):
        engines = engines_for(Path(args.target), drafts, ks, threads, args.fixed, args.batch)
        print(f"\n== {threads} thread(s) per pass, runtime {engines['plain'].info['runtime']}")
        texts = prompts(args.prompt_chars)
        ids = {label: engines["plain"].encode(p) for label, p in texts.items()}
        if llama is not None:
            llama.load(max(map(len, ids.values())) + args.new_tokens + ks[-1] + 16)
        for label, prompt in texts.items():
            peer = llama.contenders(ids[label], args.new_tokens, threads) if llama is not None else None
            results[(threads, label)] = figures = measure(engines, prompt, args.new_tokens, args.rounds, peer,
                                                          args.batch)
            if llama is not None:
                peer_figures(figures, llama)
            report(label, len(ids[label]), figures)
        for e in engines.values():
            e.close()
    return results


if __name__ == "__main__":
    main()
