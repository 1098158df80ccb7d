"""prunus beside llama.cpp on a CPU, precision by precision (``serve_throughput.py --peer llamacpp``).

In one run, rounds alternating every contender (median reported), the same prompt token ids
for all (prunus's tokenizer; llama.cpp and Hugging Face take the ids), greedy, prefill included:

* decode tokens/s at batch 1 (``tokens`` new tokens after a short prompt) and the time to the
  first token of a 512-token prompt, at each thread count;
* tokens/s at batch 1, 2, 4 and 8 at one thread count: prunus backends, llama.cpp (B sequences
  in one context, one ``llama_batch`` of B tokens a step) and Hugging Face ``generate()``
  (left-padded), plotted against the batch size;
* ratios prunus / llama.cpp per precision (fp32 / F32, int8 / Q8_0, int4 / Q4_0), and greedy
  token agreement of llama.cpp F32 with the prunus fp32 contenders;
* with og contenders (``_ort_genai_peer.OgContender``): onnxruntime-genai's own runtime on each, timed the same
  way in a process of its own, and ratios prunus / onnxruntime-genai: a prunus contender against og on the same
  export dir, and every prunus contender of a precision against og on a model dir prunus did not write (the
  model builder's).

A contender is a label, a dir ``Engine.load`` takes and a precision (``_llamacpp_peer.Contender``),
so a new backend or export joins by adding one to the list. Each prunus contender runs in a process
of its own (``_prunus_worker.py``), as llama.cpp does, and is timed there around ``Engine.generate``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from benchmarks._llamacpp_peer import GGUF_TYPES, Contender, LlamaCppPeer
from benchmarks._ort_genai_peer import OgContender, OrtGenaiWorker
from benchmarks.harness import WorkerProcess

BATCHES = (1, 2, 4, 8)
PRUNUS_WORKER = "benchmarks._prunus_worker"  # run with -m from the repository root, as the benchmarks are
LONG = 512  # tokens of the time-to-first-token prompt
# Idle seconds before each timed run: a runtime's pool threads spin on after its run (ONNX Runtime's, llama.cpp's),
# taking a core from whatever runs next in another process (docs/defaults.md).
SETTLE_S = 0.25


@dataclass
class Runner:
    """One contender as this section drives it: ``run(prompts, n_new)`` -> {"seconds", "tokens"}."""

    label: str
    kind: str  # "prunus", "llama.cpp", "ort-genai" or "hf"
    precision: str
    run: Callable[[list[list[int]], int], dict]
    path: Path | None = None  # the dir a prunus or onnxruntime-genai contender loads
    tps: dict = field(default_factory=dict)  # {(threads, batch): [tokens/s per round]}
    ttft: dict = field(default_factory=dict)  # {threads: [seconds per round]}
    tokens: dict = field(default_factory=dict)  # {batch: greedy tokens of the first round}


class PrunusWorker(WorkerProcess):
    """One prunus contender's Engine in a process of its own (``_prunus_worker.py``)."""

    def __init__(self, c: Contender):
        super().__init__([sys.executable, "-m", PRUNUS_WORKER], f"prunus ({c.label})")
        self.path, self.prompt_graph, self.native = c.path, c.prompt_graph, c.native

    def load(self, threads: int, max_batch: int, max_len: int) -> Callable:
        self.call(op="load", path=str(self.path), max_batch=max_batch, max_len=max_len, threads=threads,
                  prompt_graph=self.prompt_graph, native=self.native)
        return self.run

    def run(self, prompts: list[list[int]], n_new: int) -> dict:
        return self.call(op="generate", prompts=prompts, n_new=n_new)


def hf_run(model, threads: int) -> Callable:
    """Hugging Face ``generate()`` at ``threads`` torch threads, prompts left-padded as its decoders expect."""
    def run(prompts: list[list[int]], n_new: int) -> dict:
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            t = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                                     do_sample=False, pad_token_id=0)
            dt = time.perf_counter() - t
        finally:
            torch.set_num_threads(before)
        return {"seconds": dt, "tokens": out[:, width:].tolist()}
    return run


def llama_run(peer: LlamaCppPeer, name: str, threads: int, n_seq: int) -> Callable:
    def run(prompts: list[list[int]], n_new: int) -> dict:
        return peer.generate(name, prompts, n_new, threads, n_seq)
    return run


def long_prompt(tokenizer, n: int) -> list[int]:
    """The first ``n`` tokens of a fixed standard-library source (the same text on every machine of a Python version)."""
    import json.decoder

    return tokenizer.encode(inspect.getsource(json.decoder) * 4)[:n]


@contextlib.contextmanager
def runners(contenders: list[Contender], peer: LlamaCppPeer, hf, threads: int, max_batch: int, max_len: int,
            og: list[OgContender] = ()):
    """Every contender loaded at ``threads`` for batches up to ``max_batch``: prunus Engines (a process each),
    llama.cpp per precision, onnxruntime-genai on each of ``og`` (a process each), Hugging Face (in this process,
    alone with the bookkeeping)."""
    with contextlib.ExitStack() as stack:
        out = [Runner(c.label, "prunus", c.precision,
                      stack.enter_context(PrunusWorker(c)).load(threads, max_batch, max_len), path=c.path)
               for c in contenders]
        for precision in sorted({c.precision for c in contenders}, key=list(GGUF_TYPES).index):
            name = GGUF_TYPES[precision][0]
            out.append(Runner(f"llama.cpp {name}", "llama.cpp", precision, llama_run(peer, name, threads, max_batch)))
        out += [Runner(c.label, "ort-genai", c.precision, stack.enter_context(OrtGenaiWorker(c)).load(threads),
                       path=c.path) for c in og]
        if hf is not None:
            out.append(Runner("HF generate()", "hf", "fp32", hf_run(hf, threads)))
        yield out


def batch1_round(rs: list[Runner], short: list[int], long: list[int], n: int, threads: int, first: bool) -> None:
    """One alternating round: each contender decodes ``n`` tokens after ``short``, then prefills ``long``."""
    for r in rs:
        time.sleep(SETTLE_S)
        res = r.run([short], n)
        r.tps.setdefault((threads, 1), []).append(n / res["seconds"])
        if first:
            r.tokens[(threads, 1)] = res["tokens"]
        time.sleep(SETTLE_S)
        r.ttft.setdefault(threads, []).append(r.run([long], 1)["seconds"])


def sweep_round(rs: list[Runner], batches: dict[int, list[list[int]]], n: int, threads: int, first: bool) -> None:
    """One alternating round of batches 2, 4, 8 (batch 1 comes from the batch-1 rounds)."""
    for b, prompts in batches.items():
        for r in rs:
            time.sleep(SETTLE_S)
            res = r.run(prompts, n)
            r.tps.setdefault((threads, b), []).append(b * n / res["seconds"])
            if first:
                r.tokens[(threads, b)] = res["tokens"]


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """Greedy agreement of two batches of sequences: identical ones, and the mean matching prefix."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))) for x, y in zip(a, b)]
    return (f"{same}/{len(a)} sequences identical, matching prefix {statistics.mean(prefix):.1f} of "
            f"{len(a[0])} tokens (min {min(prefix)})")


def busy_cores(seconds: float = 1.0) -> float | None:
    """How many cores other processes kept busy over ``seconds`` while this one slept (from /proc/stat; None
    where there is none)."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all jiffies, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (1 - (idle1 - idle0) / max(1, total1 - total0)) * (os.cpu_count() or 1)


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report_batch1(rs: list[Runner], threads: list[int], n: int, long_n: int) -> list[str]:
    """The batch-1 table and the prunus / llama.cpp ratios per precision; returns the lines printed."""
    lines = []
    for k in threads:
        lines.append(f"   {k} thread(s), batch 1: {n} new tokens after a short prompt (prefill included); "
                     f"time to first token of a {long_n}-token prompt")
        for r in rs:
            lines.append(f"     {r.label:44s} [{r.precision:4s}] {med(r.tps[(k, 1)]):8.2f} tokens/s   "
                         f"TTFT {1000 * med(r.ttft[k]):8.1f} ms")
        peers = {r.precision: r for r in rs if r.kind == "llama.cpp"}
        for r in rs:
            p = peers.get(r.precision)
            if r.kind != "prunus" or p is None:
                continue
            tps, ttft = med(r.tps[(k, 1)]) / med(p.tps[(k, 1)]), med(p.ttft[k]) / med(r.ttft[k])
            lines.append(f"     ratio {r.label} / {p.label}: decode {tps:5.2f}x, first token {ttft:5.2f}x "
                         f"(>= 1: prunus at least as fast){'' if tps >= 1 else '   BEHIND'}")
        for r, p in og_pairs(rs):
            tps, ttft = med(r.tps[(k, 1)]) / med(p.tps[(k, 1)]), med(p.ttft[k]) / med(r.ttft[k])
            lines.append(f"     ratio {r.label} / {p.label}: decode {tps:5.2f}x, first token {ttft:5.2f}x"
                         f"{'' if tps >= 1 else '   BEHIND'}")
    for line in lines:
        print(line)
    return lines


def og_pairs(rs: list[Runner]) -> list[tuple[Runner, Runner]]:
    """(prunus, onnxruntime-genai) pairs of one precision: og on the same dir as the prunus contender, or og on a
    dir no prunus contender loads (the model builder's), beside every prunus contender of its precision."""
    ours = {r.path for r in rs if r.kind == "prunus"}
    return [(r, p) for p in rs if p.kind == "ort-genai" for r in rs
            if r.kind == "prunus" and r.precision == p.precision and (r.path == p.path or p.path not in ours)]


def report_sweep(rs: list[Runner], k: int, n: int) -> None:
    print(f"   {k} thread(s), tokens/s at batch {', '.join(map(str, BATCHES))} ({n} new tokens per sequence):")
    for r in rs:
        print(f"     {r.label:44s} [{r.precision:4s}] " + "".join(f"{med(r.tps.get((k, b), [])):9.1f}" for b in BATCHES))
    peers = {r.precision: r for r in rs if r.kind == "llama.cpp"}
    for r in rs:
        p = peers.get(r.precision)
        if r.kind == "prunus" and p is not None:
            print(f"     ratio {r.label} / {p.label}: " + "  ".join(
                f"b{b} {med(r.tps[(k, b)]) / med(p.tps[(k, b)]):5.2f}x" for b in BATCHES))
    for r, p in og_pairs(rs):
        print(f"     ratio {r.label} / {p.label}: " + "  ".join(
            f"b{b} {med(r.tps.get((k, b), [])) / med(p.tps.get((k, b), [])):5.2f}x" for b in BATCHES))


def report_agreement(rs: list[Runner], keys: list[tuple[int, int]]) -> None:
    """Greedy tokens of each llama.cpp file against the prunus contenders of its precision, and of
    onnxruntime-genai against prunus on the same dir (its batches right-padded, as og reads them)."""
    pairs = [(p, r) for p in rs if p.kind == "llama.cpp"
             for r in rs if r.kind == "prunus" and r.precision == p.precision]
    pairs += [(p, r) for r, p in og_pairs(rs) if r.path == p.path]
    for p, r in pairs:
        for key in keys:
            if key in p.tokens and key in r.tokens:
                print(f"     greedy, {p.label} vs {r.label}, {key[0]} thr batch {key[1]}: "
                      f"{agreement(p.tokens[key], r.tokens[key])}")


def plot_batches(rs: list[Runner], k: int, n: int, title: str, path: Path) -> None:
    """Tokens/s against batch size, one line per contender: prunus solid, llama.cpp dashed, onnxruntime-genai
    dash-dot, HF dotted; one colour family per precision (fp32 blue, int8 orange, int4 green), so each prunus line
    sits beside its llama.cpp peer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"prunus": ("-", "o"), "llama.cpp": ("--", "s"), "ort-genai": ("-.", "D"), "hf": (":", "^")}
    families = {"fp32": "Blues", "int8": "Oranges", "int4": "Greens"}
    colors = {}
    for precision, cmap in families.items():
        same = [r for r in rs if r.precision == precision and r.kind != "hf"]
        for j, r in enumerate(same):
            colors[r.label] = plt.get_cmap(cmap)(0.95 - 0.5 * j / max(1, len(same) - 1))
    fig, ax = plt.subplots(figsize=(10, 5.5), layout="constrained")
    ends, prunus_markers = [], iter(["o", "D", "v", "P", "X", "*", "h", "<", ">", "p"] * 4)
    for r in rs:
        ls, marker = styles[r.kind]
        marker = next(prunus_markers) if r.kind == "prunus" else marker
        color = colors.get(r.label, "dimgray")
        ys = [med(r.tps.get((k, b), [])) for b in BATCHES]
        name = r.label if r.precision in r.label or r.kind == "llama.cpp" else f"{r.label} ({r.precision})"
        ax.plot(BATCHES, ys, linestyle=ls, marker=marker, color=color, linewidth=2, label=name)
        ends.append((ys[-1], color))
    top = max(y for y, _ in ends)
    placed = []
    for y, color in sorted(ends, key=lambda e: e[0]):  # the batch-8 values, nudged apart so none overlap
        y_text = max(y, placed[-1] + 0.035 * top) if placed else y
        placed.append(y_text)
        ax.annotate(f"{y:.0f}", (BATCHES[-1], y), xytext=(BATCHES[-1] * 1.07, y_text), va="center", fontsize=8,
                    color=color)
    ax.set_xscale("log", base=2)
    ax.set_xticks(BATCHES, [str(b) for b in BATCHES])
    ax.set_xlim(0.85, 10.5)
    ax.set_ylim(0, 1.08 * max(placed))
    ax.set_xlabel("batch size (sequences decoded together)")
    ax.set_ylabel("generated tokens/s (all sequences)")
    ax.set_title(f"{title}: greedy decode, {n} new tokens per sequence, prefill included, {k} thread(s)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8,
              title="solid prunus, dashed llama.cpp, dash-dot onnxruntime-genai, dotted HF",
              title_fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare(contenders: list[Contender], ggufs: dict[str, Path], peer: LlamaCppPeer, hf, tokenizer, prompts: list[str],
            *, max_seq_len: int, threads: list[int], sweep_threads: int, n: int, rounds: int, sweep_rounds: int,
            title: str, plot: Path, figures: list, og: list[OgContender] = ()) -> dict:
    """The whole comparison (see the module docstring); returns the medians (also written beside ``plot``).
    The first-token prompt is 512 tokens, or ``max_seq_len - 2`` for a model with a shorter context."""
    t0 = time.perf_counter()
    info = peer.info()
    print(f"   llama-cpp-python {info['version']}: {info['system'].strip()}")
    busy = busy_cores()
    if busy is not None and busy > 0.3:
        print(f"   WARNING: other processes kept {busy:.1f} of {os.cpu_count()} cores busy just now: llama.cpp's thread "
              "pool spins, so with other work on the cores its figures (above 1 thread most of all) are not fit to publish")
    short, long = tokenizer.encode(prompts[0]), long_prompt(tokenizer, min(LONG, max_seq_len - 2))
    max_len = min(max_seq_len, max(len(long) + 1, *(len(tokenizer.encode(p)) + n for p in prompts)) + 8)
    try:
        for precision, path in ggufs.items():
            peer.load(GGUF_TYPES[precision][0], path, max_len)
    except RuntimeError as e:  # a file llama.cpp refuses (e.g. a byte-level vocabulary without merges)
        print(f"   llama.cpp peer skipped: {e}")
        return {}
    print(f"   prompts: batch 1 {len(short)} tokens, first-token prompt {len(long)} tokens; {rounds} alternating rounds "
          f"at batch 1, {sweep_rounds} at batches {', '.join(map(str, BATCHES[1:]))}", flush=True)
    results: dict[str, Runner] = {}
    for k in sorted(set(threads) | {sweep_threads}):
        with runners(contenders, peer, hf, k, 1, max_len, og) as rs:
            for r in rs:  # warm-up: first passes of a session grow its arena (prunus's prompt twin: 2.7 s then 1.0 s)
                r.run([short], 4), r.run([long], 1), r.run([long], 1)
            rs = [_merge(results, r) for r in rs]
            for i in range(rounds):
                batch1_round(rs, short, long, n, k, first=i == 0)
    rs = list(results.values())
    lines = report_batch1(rs, sorted(set(threads) | {sweep_threads}), n, len(long))
    if sweep_rounds > 0:
        sweep(contenders, og, peer, hf, results, tokenizer, prompts, short, sweep_threads, max_len, n, sweep_rounds)
        report_sweep(rs, sweep_threads, n)
    report_agreement(rs, [(min(threads), 1), (sweep_threads, BATCHES[-1])])
    if sweep_rounds > 0:
        plot_batches(rs, sweep_threads, n, title, plot)
    for r in rs:
        figures += [(f"{title}: {r.label} ({r.precision}), {k} thr", med(v)) for (k, b), v in r.tps.items() if b == 1]
    summary = {r.label: {"kind": r.kind, "precision": r.precision,
                         "tokens_per_s": {f"{k} thr, batch {b}": med(v) for (k, b), v in r.tps.items()},
                         "ttft_s": {f"{k} thr": med(v) for k, v in r.ttft.items()}} for r in rs}
    plot.parent.mkdir(parents=True, exist_ok=True)
    plot.with_suffix(".json").write_text(json.dumps({"summary": summary, "batch1": lines}, indent=1))
    print(f"   plot: {plot} (figures: {plot.with_suffix('.json')}); section took {time.perf_counter() - t0:.0f} s")
    return summary


def sweep(contenders, og, peer, hf, results: dict[str, Runner], tokenizer, prompts: list[str], short: list[int],
          threads: int, max_len: int, n: int, rounds: int) -> None:
    """The batch 2-8 rounds at ``threads``, every contender loaded again for batches up to 8."""
    with runners(contenders, peer, hf, threads, BATCHES[-1], max_len, og) as fresh:
        for r in fresh:
            r.run([short] * 2, 4)  # warm-up
        swept = [_merge(results, r) for r in fresh]
        batches = {b: [tokenizer.encode(prompts[i % len(prompts)]) for i in range(b)] for b in BATCHES[1:]}
        for i in range(rounds):
            sweep_round(swept, batches, n, threads, first=i == 0)


def _merge(results: dict[str, Runner], r: Runner) -> Runner:
    """``r``'s run function under the Runner that keeps this label's figures across thread counts."""
    kept = results.setdefault(r.label, r)
    kept.run = r.run
    return kept
