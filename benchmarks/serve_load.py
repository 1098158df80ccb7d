"""Streaming load on ``prunus serve`` beside llama.cpp's server, one client script driving both.

Each contender is an OpenAI-compatible server started as a process of its own on a free port: ``prunus serve``
of a genai export dir on ONNX Runtime (``--no-native``), the same in the native kernels (``--native``, the default), the same dir under the stdlib HTTP server of
an earlier commit (``--old-ref``, run from a git worktree with this venv), and llama.cpp through
llama-cpp-python's server (``--llamacpp-python``, an interpreter with ``llama-cpp-python[server]``) on GGUF files
of the same weights (``--gguf LABEL=FILE``; prunus writes them: ``prunus convert --to-gguf DIR --type q8_0``).
``--fp32 DIR`` adds ``prunus serve`` of a float32 model dir, as it serves by default (its prepared genai export in
the native kernels, made before the timing starts) and on the torch backend (``--no-prepare``). Once a server answers its health
route, 1, 8, 32, ... threads (``--clients``) each send streamed ``POST /v1/completions`` back to back: code
prompts of about 50-200 tokens cut from the standard library's source, ``--tokens`` new tokens, greedy. A
server that takes ``min_tokens`` (vLLM's name) gets it equal to ``max_tokens`` so every answer runs to its
length; otherwise what came is counted.

Reported per contender and number of clients: output tokens/s (all text chunks / wall time), the time to the
first token p50 / p99, the gap between tokens p50 (within a stream), requests lost (not 200, or a stream that
broke); ratios prunus / llama.cpp; and, for one client, the in-process ``Engine.stream`` tokens/s on the same dir
and prompts, so that one streamed client can be set against the engine it serves. The load average is written
at the start and the end: figures taken on a busy machine say so. Writes a PNG (tokens/s and p99 time to first
token against clients, one line per contender).

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.serve_load --dir /tmp/smol/int8-genai --old-ref de7edc2^ \\
        --llamacpp-python /work/llvenv/bin/python --gguf Q8_0=/tmp/smol/model-q8_0.gguf [--fp32 DIR \\
        --gguf F32=FILE] [--clients 1,8,32,128] [--png docs/serve_load.png] [--json F]
"""

from __future__ import annotations

import argparse
import http.client
import inspect
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

from benchmarks.harness import git_tree, machine_line, show, write_results

ROOT = Path(__file__).resolve().parent.parent
PROMPT_CHARS = (260, 420, 560, 700, 840, 330, 490, 630)  # about 60-210 tokens of code
LEGEND = {"prunus ORT": "prunus serve (FastAPI), ONNX Runtime", "prunus native": "prunus serve (FastAPI), --native",
          "prunus stdlib": "stdlib server, ONNX Runtime"}
REQUESTS_PER_CLIENT = {1: 3}  # more clients: one request each


# --- prompts -------------------------------------------------------------------------------------------------------

def prompts() -> list[str]:
    """Code prompts cut from the standard library's source (they depend only on the Python version)."""
    import json as j
    import shutil
    import textwrap

    sources = [textwrap.dedent, j.dumps, shutil.copyfile, textwrap.TextWrapper._wrap_chunks, statistics.median,
               shutil.rmtree, j.loads, statistics.quantiles]
    return [inspect.getsource(fn)[:n] for fn, n in zip(sources, PROMPT_CHARS)]


def prompt_tokens(path: Path, texts: list[str]) -> list[int]:
    """Each prompt's length in the dir's tokenizer (tokenizer.json), or [] when it has none."""
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        return [len(tok.encode(t).ids) for t in texts]
    except Exception:  # only a printed range depends on it
        return []


# --- a server in a process of its own ------------------------------------------------------------------------------

@dataclass
class Contender:
    label: str
    argv: list[str]  # {port} is filled in
    health: str
    extra: dict = field(default_factory=dict)  # request fields this server takes beyond the common ones
    env: dict = field(default_factory=dict)
    kind: str = "prunus"  # prunus | llama.cpp
    engine: tuple | None = None  # (dir, native): the in-process Engine.stream it is set against
    drop_env: tuple = ()  # variables of this process's environment it does not get


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """Start a contender, wait for its health route, stop it (its log's tail explains a failed start)."""

    def __init__(self, c: Contender, tmp: Path):
        self.port = free_port()
        self.log = open(tmp / f"{c.label.replace(' ', '_').replace('/', '_')}.log", "w+")
        argv = [a.replace("{port}", str(self.port)) for a in c.argv]
        env = {**{k: v for k, v in os.environ.items() if k not in c.drop_env}, **c.env}
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=tempfile.gettempdir())
        self.wait(c, 300)

    def tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return "".join(self.log.readlines()[-8:])

    def wait(self, c: Contender, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{c.label} exited {self.proc.returncode}:\n{self.tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", c.health)
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{c.label}: not ready in {timeout:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# --- the client ----------------------------------------------------------------------------------------------------

@dataclass
class Stream:
    ok: bool
    tokens: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    error: str = ""


def stream_once(port: int, prompt: str, n: int, extra: dict) -> Stream:
    """One streamed completion; the text chunks' arrival times."""
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True, **extra}).encode()
    t0 = time.perf_counter()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return Stream(False, error=f"{resp.status} {resp.read()[:200]!r}")
        times, done = [], False
        for raw in iter(resp.readline, b""):
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                return Stream(False, len(times), error=str(obj["error"])[:200])
            if any(ch.get("text") for ch in obj.get("choices", [])):
                times.append(time.perf_counter())
        conn.close()
    except (OSError, http.client.HTTPException, ValueError) as e:
        return Stream(False, error=f"{type(e).__name__}: {e}")
    if not done or not times:
        return Stream(False, len(times), error="the stream ended without [DONE]" if not done else "no text")
    return Stream(True, len(times), times[0] - t0, [b - a for a, b in zip(times, times[1:])])


def drive(port: int, clients: int, texts: list[str], n: int, extra: dict) -> dict:
    """``clients`` threads sending streamed requests back to back; the figures of the level."""
    per = REQUESTS_PER_CLIENT.get(clients, 1)
    got: list[Stream] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for k in range(per):
            s = stream_once(port, texts[(i + k) % len(texts)], n, extra)
            with lock:
                got.append(s)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarize(got, time.perf_counter() - t0)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(got: list[Stream], wall: float) -> dict:
    ok = [s for s in got if s.ok]
    ttft = [s.ttft for s in ok]
    gaps = [g for s in ok for g in s.gaps]
    return {"requests": len(got), "lost": len(got) - len(ok), "errors": sorted({s.error for s in got if s.error})[:3],
            "tokens": sum(s.tokens for s in got), "wall_s": wall, "tok_s": sum(s.tokens for s in got) / wall,
            "tokens_per_request": statistics.mean(s.tokens for s in ok) if ok else 0.0,
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "gap_p50": pct(gaps, 0.5)}


def run_contender(c: Contender, tmp: Path, levels: list[int], texts: list[str], n: int, budget_s: float) -> dict:
    """{clients: figures} for one contender (after one warm-up request), or {"failed": why}. A level whose
    tokens would take longer than ``budget_s`` at the previous level's rate is skipped (said so)."""
    try:
        server = Server(c, tmp)
    except RuntimeError as e:
        print(f"  {c.label}: failed to start: {e}", flush=True)
        return {"failed": str(e)[-500:]}
    try:
        warm = stream_once(server.port, texts[0], 8, c.extra)
        if not warm.ok:
            print(f"  {c.label}: the warm-up request failed: {warm.error}", flush=True)
            return {"failed": warm.error}
        out = {}
        for k in levels:
            if out:
                rate = list(out.values())[-1]["tok_s"]
                estimate = k * REQUESTS_PER_CLIENT.get(k, 1) * n / max(rate, 1e-9)
                if estimate > budget_s:
                    print(f"  {c.label:24s} {k:4d} clients: skipped (about {estimate:.0f} s at "
                          f"{rate:.1f} tok/s, over --level-budget-s {budget_s:.0f})", flush=True)
                    continue
            out[k] = drive(server.port, k, texts, n, c.extra)
            r = out[k]
            print(f"  {c.label:24s} {k:4d} clients: {r['tok_s']:7.1f} tok/s, TTFT p50 {fmt_ms(r['ttft_p50'])} "
                  f"p99 {fmt_ms(r['ttft_p99'])} ms, gap p50 {fmt_ms(r['gap_p50'])} ms, lost {r['lost']}/"
                  f"{r['requests']}, {r['tokens_per_request']:.1f} tokens/request {r['errors'] or ''}", flush=True)
        return out
    finally:
        server.stop()


def fmt_ms(v: float | None) -> str:
    return "n/a" if v is None else f"{1e3 * v:.0f}"


# --- the in-process engine -----------------------------------------------------------------------------------------

_ENGINE = r"""
import json, sys, time
path, native, n = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
texts = json.loads(sys.stdin.read())
from prunus.serve import Engine
with Engine.load(path, native=native) as engine:
    list(engine.stream(texts[0], max_new_tokens=8, temperature=0))
    t0, tokens = time.perf_counter(), 0
    for text in texts:
        tokens += sum(1 for tok in engine.stream(text, max_new_tokens=n, temperature=0, ignore_eos=True) if tok.text)
    print(json.dumps({"tok_s": tokens / (time.perf_counter() - t0), "tokens": tokens}))
"""


def in_process(path: Path, native: bool, texts: list[str], n: int) -> float | None:
    """Text tokens/s of ``Engine.stream`` on the same dir and requests as one client sends, back to back."""
    seq = [texts[k % len(texts)] for k in range(REQUESTS_PER_CLIENT[1])]
    r = subprocess.run([sys.executable, "-c", _ENGINE, str(path), "1" if native else "0", str(n)],
                       input=json.dumps(seq), capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    if r.returncode != 0:
        print(f"  in-process Engine on {path} failed: {r.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    tps = json.loads(r.stdout.strip().splitlines()[-1])["tok_s"]
    print(f"  in-process Engine.stream{' (native)' if native else ''}, {len(seq)} requests back to back: "
          f"{tps:.1f} tok/s", flush=True)
    return tps


# --- contenders ----------------------------------------------------------------------------------------------------

def prunus_serve(label: str, path: Path, args, *flags: str, env: dict | None = None, new: bool = True,
                 engine: tuple | None = None) -> Contender:
    argv = [sys.executable, "-m", "prunus.cli.main", "serve", str(path), "--port", "{port}", "--max-batch",
            str(args.max_batch), "--max-queue", str(args.max_queue), *flags]
    # 'model' is required: the served dir's name; the stdlib server refuses fields it does not know
    extra = {"model": Path(path).name, "min_tokens": args.tokens} if new else {}
    return Contender(label, argv, "/health", extra, {"OMP_WAIT_POLICY": "PASSIVE", **(env or {})}, engine=engine)


def llamacpp(label: str, gguf: str, args) -> Contender:
    argv = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", gguf, "--n_ctx", "2048", "--n_threads",
            str(args.threads), "--n_threads_batch", str(args.threads), "--port", "{port}",
            "--interrupt_requests", "False", *args.llamacpp_arg]  # by default a new request cuts a running stream
    # its default thread policy: no OMP_WAIT_POLICY
    return Contender(label, argv, "/v1/models", {"min_tokens": args.tokens}, kind="llama.cpp",
                     drop_env=("OMP_WAIT_POLICY",))


def contenders(args, tmp: Path) -> list[Contender]:
    """The order they run in: the slowest (native kernels on a busy machine) last."""
    out = [prunus_serve("prunus ORT", args.dir, args, "--no-native", engine=(args.dir, False))]
    if args.old_ref:
        out.append(prunus_serve(f"prunus stdlib {args.old_ref}", args.dir, args,
                                env={"PYTHONPATH": str(git_tree(args.old_ref, tmp, "old"))}, new=False))
    if args.fp32:  # the model dir as `prunus serve` serves it by default (its prepared genai export in the native
        # kernels), and on torch
        out += [prunus_serve("prunus fp32 prepared", args.fp32, args),
                prunus_serve("prunus fp32 torch", args.fp32, args, "--no-prepare")]
    if args.llamacpp_python:
        out += [llamacpp(f"llama.cpp {label}", path, args) for label, path in (g.split("=", 1) for g in args.gguf)]
    if not args.no_native:
        out.append(prunus_serve("prunus native", args.dir, args, "--native", engine=(args.dir, True)))
    return out


# --- the report ----------------------------------------------------------------------------------------------------

def peer_of(label: str, results: dict) -> str | None:
    """The llama.cpp contender a prunus one is set against: F32 for the fp32 dir, Q8_0 (or the first) otherwise."""
    peers = [k for k in results if k.startswith("llama.cpp") and "failed" not in results[k]]
    want = "F32" if "fp32" in label else "Q8_0"
    return next((p for p in peers if want in p), None)


def report(results: dict, engine_tps: dict, levels: list[int]) -> None:
    rows = []
    for label, res in results.items():
        if "failed" in res:
            rows.append([label, "", "failed", "", "", "", "", "", "", ""])
            continue
        peer = peer_of(label, results)
        for k in levels:
            r = res.get(k)
            if r is None:
                rows.append([label, str(k), "skipped", "", "", "", "", "", "", ""])
                continue
            p = results[peer].get(k) if peer and not label.startswith("llama.cpp") else None
            ratio = f"{r['tok_s'] / p['tok_s']:.2f}" if p else ""
            ttft_ratio = f"{r['ttft_p50'] / p['ttft_p50']:.2f}" if p and r["ttft_p50"] and p["ttft_p50"] else ""
            rows.append([label, str(k), f"{r['tok_s']:.1f}", fmt_ms(r["ttft_p50"]), fmt_ms(r["ttft_p99"]),
                         fmt_ms(r["gap_p50"]), f"{r['lost']}/{r['requests']}", f"{r['tokens_per_request']:.1f}",
                         ratio, ttft_ratio])
    show("streamed /v1/completions: output tokens/s, time to first token, gap between tokens (ms); ratios are "
         "prunus / llama.cpp (Q8_0 for int8, F32 for fp32)",
         ["contender", "clients", "tok/s", "TTFT p50", "TTFT p99", "gap p50", "lost", "tokens / req", "tok/s ratio",
          "TTFT p50 ratio"], rows, width=150)
    old = next((k for k in results if "stdlib" in k and "failed" not in results[k]), None)
    new = results.get("prunus ORT", {})
    for k in (levels if old and "failed" not in new else []):
        a, b = new.get(k), results[old].get(k)
        if a and b:
            print(f"{k} clients: prunus ORT / {old}: tok/s {a['tok_s'] / b['tok_s']:.2f}, TTFT p50 "
                  f"{a['ttft_p50'] / b['ttft_p50']:.2f}, p99 {a['ttft_p99'] / b['ttft_p99']:.2f}, gap p50 "
                  f"{a['gap_p50'] / b['gap_p50']:.2f}")
    for label, tps in engine_tps.items():
        served = results.get(label, {}).get(1)
        if tps and served:
            print(f"{label}: one streamed client {served['tok_s']:.1f} tok/s, in-process Engine.stream {tps:.1f} "
                  f"tok/s: served / in-process {served['tok_s'] / tps:.3f}")


def plot(results: dict, levels: list[int], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.6))
    for label, res in results.items():
        if "failed" in res:
            continue
        style = "--" if label.startswith("llama.cpp") else "-"
        name = LEGEND.get(label.split(" de")[0], label) + (f" ({label.split()[-1]})" if "stdlib" in label else "")
        ks = [k for k in levels if k in res]
        a.plot(ks, [res[k]["tok_s"] for k in ks], style, marker="o", label=name)
        b.plot(ks, [res[k]["ttft_p99"] or float("nan") for k in ks], style, marker="o", label=name)
    for ax, name in ((a, "output tokens/s (all streams)"), (b, "time to first token, p99 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(k) for k in levels])
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    b.set_yscale("log")
    b.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    a.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# --- main ----------------------------------------------------------------------------------------------------------

class CutShort(Exception):
    pass


def _cut_short(*_) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise CutShort

def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="a genai export dir (served on ONNX Runtime and --native)")
    p.add_argument("--fp32", type=Path, default=None, help="also a float32 model dir (prepared, and on the torch backend)")
    p.add_argument("--old-ref", default=None, help="an earlier commit whose server also serves --dir")
    p.add_argument("--llamacpp-python", default=None, help="an interpreter with llama-cpp-python[server]")
    p.add_argument("--gguf", action="append", default=[], metavar="LABEL=FILE")
    p.add_argument("--llamacpp-arg", action="append", default=[], help="one more argument for llama_cpp.server")
    p.add_argument("--clients", default="1,8,32", type=lambda v: [int(k) for k in v.split(",")])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--no-native", action="store_true")
    p.add_argument("--level-budget-s", type=float, default=300.0,
                   help="skip a level that would take longer than this at the previous level's rate")
    p.add_argument("--reverse", action="store_true", help="run the contenders in the reverse order")
    p.add_argument("--no-engine", action="store_true", help="leave out the in-process Engine.stream figure")
    p.add_argument("--only", default=None, help="run only the contenders whose label holds one of these (a,b)")
    p.add_argument("--add", action="append", default=[], metavar="JSON",
                   help="an earlier run's --json: the levels it measured that this run did not join the table and plot")
    p.add_argument("--png", default=None)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    texts = prompts()
    lengths = prompt_tokens(args.dir, texts)
    start_load = os.getloadavg()
    print(machine_line())
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in start_load)}")
    print(f"{len(texts)} prompts of {min(lengths, default=0)}-{max(lengths, default=0)} tokens, {args.tokens} new "
          f"tokens, greedy, clients {args.clients}, prunus --max-batch {args.max_batch}", flush=True)
    engine_tps, results = {}, {}
    signal.signal(signal.SIGTERM, _cut_short)  # SIGTERM stops the servers and reports what was measured
    with tempfile.TemporaryDirectory(prefix="prunus-serve-load-") as tmp:
        try:
            for c in contenders(args, Path(tmp))[::-1 if args.reverse else 1]:
                if args.only and not any(w in c.label for w in args.only.split(",")):
                    continue
                print(f"{c.label}: load average {os.getloadavg()[0]:.2f} at its start", flush=True)
                if c.engine and not args.no_engine:
                    engine_tps[c.label] = in_process(*c.engine, texts, args.tokens)
                results[c.label] = run_contender(c, Path(tmp), args.clients, texts, args.tokens, args.level_budget_s)
        except CutShort:
            print("cut short (SIGTERM): the contenders measured so far are reported", flush=True)
        finally:
            if args.old_ref:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(tmp) / "old-tree")],
                               capture_output=True)
    end_load = os.getloadavg()
    print(f"load average at end: {' '.join(f'{v:.2f}' for v in end_load)}")
    if args.json:
        write_results(args.json, {k: str(v) for k, v in vars(args).items()}, results, engine_tps=engine_tps,
                      load_average={"start": start_load, "end": end_load})
    loads = [start_load[0], end_load[0]]
    levels = merge(results, engine_tps, loads, args.add, args.clients)
    report(results, engine_tps, levels)
    if args.png:
        runs = f"{1 + len(args.add)} runs, " if args.add else ""
        plot(results, levels, args.png, f"SmolLM2-135M, {args.tokens} new tokens per stream; {runs}load average "
             f"{min(loads):.1f}-{max(loads):.1f} ({machine_line().split(': ', 1)[1]})")


def merge(results: dict, engine_tps: dict, loads: list[float], files: list[str], levels: list[int]) -> list[int]:
    """Add the levels an earlier run's JSON (``--add``) measured and this one did not; all the levels."""
    levels = set(levels)
    for f in files:
        body = json.loads(Path(f).read_text())
        loads += [body["load_average"]["start"][0], body["load_average"]["end"][0]]
        for label, tps in body.get("engine_tps", {}).items():  # set against one client of the same run
            mine = results.get(label, {})
            if tps and (label not in engine_tps or (1 not in mine and "1" in body["results"].get(label, {}))):
                engine_tps[label] = tps
        for label, res in body["results"].items():
            if "failed" in res:
                results.setdefault(label, res)
                continue
            mine = results.setdefault(label, {})
            if "failed" in mine:
                mine.clear()
            for k, r in res.items():
                mine.setdefault(int(k), r)
                levels.add(int(k))
    return sorted(levels)


if __name__ == "__main__":
    main()
