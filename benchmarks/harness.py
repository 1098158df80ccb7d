"""How every benchmark measures and reports: rounds of contenders, spreads, ratios, the machine, the results file.

A figure from one run swings by 2x on a shared machine, so contenders run in alternating rounds (drift hits all
alike), each figure is printed as its median with its range, and a ratio whose two ranges overlap is marked as
within noise ("≈"). Every report names the machine it ran on (CPU model, threads, ``OMP_WAIT_POLICY``) and can be
written as JSON beside the printed tables. A contender that must not share an interpreter with another runs in a
:class:`WorkerProcess`, driven by one JSON line per request.

Only the standard library (rich for tables, imported when a table is shown): the llama.cpp worker runs in an
interpreter of its own.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable


NOTE = "ms: median [interquartile range] of the repetitions; ≈: the two spreads overlap, a difference within noise"


def cpu_model() -> str:
    """The CPU's name, as the kernels' plan cache keys on it. The peers' workers import this file from venvs of their
    own without prunus, so prunus is imported here, when a figure is written."""
    from prunus.native.build import cpu_model as read
    return read()


# --- rounds --------------------------------------------------------------------------------------------------------

def alternating_rounds(contenders: dict[str, Callable[[], float | list[float] | None]],
                       rounds: int) -> dict[str, list[float]]:
    """Each contender's figures from ``rounds`` rounds (a call gives one figure or a list of them); the order flips
    every round, so drift falls on all. A contender that returns None (it failed; it said why) adds nothing."""
    got: dict[str, list[float]] = {k: [] for k in contenders}
    items = list(contenders.items())
    for r in range(rounds):
        for name, fn in (items if r % 2 == 0 else items[::-1]):
            v = fn()
            if isinstance(v, list):
                got[name] += v
            elif v is not None:
                got[name].append(v)
    return got


def alternating_samples(fns: dict, reps: int) -> dict[str, list[float]]:
    """Seconds of each of ``reps`` calls of each fn (after one warm-up call each), calls alternating."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


# --- spreads and ratios --------------------------------------------------------------------------------------------

def spread(samples: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of the samples; min and max when there are fewer than 4."""
    s = sorted(samples)
    if len(s) < 4:
        return s[0], statistics.median(s), s[-1]
    q1, q2, q3 = statistics.quantiles(s, n=4, method="inclusive")
    return q1, q2, q3


def overlap(a: list[float], b: list[float]) -> bool:
    """Whether the spreads of two sets of samples overlap: their difference is within noise."""
    a_lo, _, a_hi = spread(a)
    b_lo, _, b_hi = spread(b)
    return a_lo <= b_hi and b_lo <= a_hi


def median_range(values: list[float], spec: str = ".1f") -> str:
    """The median and the full range of the values: ``12.3 (11.0-13.9)``; ``failed`` when there are none."""
    if not values:
        return "failed"
    return f"{format(statistics.median(values), spec)} ({format(min(values), spec)}-{format(max(values), spec)})"


def ms(samples: list[float]) -> str:
    """Median milliseconds and the spread: ``1.23 [1.10–1.40]``."""
    lo, mid, hi = spread(samples)
    return f"{1e3 * mid:.2f} [{1e3 * lo:.2f}–{1e3 * hi:.2f}]"


def median_ratio(a: list[float], b: list[float], spec: str = ".3f") -> str:
    """The ratio of medians a / b, marked ``≈`` (within noise) when the spreads overlap; ``n/a`` when one is empty."""
    if not a or not b:
        return "n/a"
    r = format(statistics.median(a) / statistics.median(b), spec)
    return f"≈ {r}" if overlap(a, b) else r


def ratio_line(ours: str, ours_values: list[float], peer: str, peer_values: list[float], unit: str,
               goal_text: str = "") -> str:
    """The lines a side-by-side prints last: each contender's median (range) and the ratio ours / peer."""
    width = max(len(ours), len(peer)) + 1
    lines = [f"{peer + ':':{width}s} {median_range(peer_values, ',.0f')} {unit}",
             f"{ours + ':':{width}s} {median_range(ours_values, ',.0f')} {unit}",
             f"ratio {ours} / {peer}: {median_ratio(ours_values, peer_values)}" + (f"  ({goal_text})" if goal_text
                                                                                  else "")]
    return "\n".join(lines)


# --- tables --------------------------------------------------------------------------------------------------------

SHOWN: list[dict] = []  # every table shown in this process, as ``python -m benchmarks.record`` keeps them


def show(title: str, headers: list[str], rows: list[list[str]], width: int = 120) -> None:
    """A table: the first column left-aligned (labels), the others right-aligned (figures)."""
    from rich.console import Console
    from rich.table import Table

    SHOWN.append({"title": title, "headers": [str(h) for h in headers], "rows": [[str(c) for c in r] for r in rows]})
    table = Table(title=title, title_justify="left")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=max(width, len(title) + 4)).print(table)


def fmt(v: float | None, spec: str = ",.0f") -> str:
    return "n/a" if v is None else format(v, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def goal(v: float | None, ok) -> str:
    """Whether a figure meets its goal (``ok(v)``): yes, no, or n/a when it was not measured."""
    return "n/a" if v is None else ("yes" if ok(v) else "no")


# --- the machine and the results file ------------------------------------------------------------------------------

def machine() -> dict:
    """What a figure depends on besides the code: CPU, threads, ``OMP_WAIT_POLICY``, torch when it is loaded."""
    import sys

    info = {"cpu": cpu_model(), "cpu_threads": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is not None:
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    return info


def machine_line() -> str:
    """``machine: <CPU>, 16 CPU threads, torch 2.x (4 threads), OMP_WAIT_POLICY=PASSIVE``."""
    m = machine()
    torch = f", torch {m['torch']} ({m['torch_threads']} threads)" if "torch" in m else ""
    return f"machine: {m['cpu']}, {m['cpu_threads']} CPU threads{torch}, OMP_WAIT_POLICY={m['omp_wait_policy']}"


def write_results(path: str | Path, settings: dict, results: dict, **extra) -> Path:
    """Write ``{"machine", "settings", "results", ...extra}`` as JSON to ``path`` (its folder made); the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "settings": settings,
            "results": results, **extra}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=2, default=str))
    os.replace(tmp, path)
    return path


# --- a contender in a process of its own ---------------------------------------------------------------------------

class WorkerProcess:
    """The parent side: writes ``{"op": ..., ...}`` to the worker's stdin and reads one JSON answer from its stdout.
    The worker's stderr goes to a temporary log whose last lines explain a worker that died."""

    def __init__(self, argv: list[str], what: str, env: dict[str, str] | None = None):
        self.what = what
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-worker-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)

    def call(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            tail = "".join(self.log.readlines()[-5:])
            raise RuntimeError(f"the {self.what} worker exited (code {self.proc.wait()}); its stderr ends:\n{tail}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{self.what} worker, {request['op']}: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(handlers: dict[str, Callable[..., dict]], inp, out) -> None:
    """The worker side: answer requests from ``inp`` on ``out`` with ``handlers[op](**the other fields)``, or
    ``{"error": "..."}`` when the handler raises, until ``{"op": "quit"}`` or end of input."""
    for line in inp:
        req = json.loads(line)
        op = req.pop("op", None)
        if op == "quit":
            break
        try:
            ans = handlers[op](**req) if op in handlers else {"error": f"unknown op {op!r}"}
        except Exception as e:  # answered, so the benchmark can say what failed
            ans = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(ans) + "\n")
        out.flush()


def git_tree(ref: str, tmp: Path, name: str = "earlier") -> Path:
    """A worktree of prunus at ``ref`` under ``tmp`` and a dir holding a ``prunus`` link to it, returned: put it first
    on the import path (PYTHONPATH) to import that commit's prunus. Remove it with ``git worktree remove``."""
    root = Path(__file__).resolve().parents[1]
    work = tmp / f"{name}-tree"
    subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(work), ref], check=True,
                   capture_output=True)
    (tmp / f"{name}-imp").mkdir()
    (tmp / f"{name}-imp" / "prunus").symlink_to(work)
    return tmp / f"{name}-imp"


def timed_threads(threads: list) -> float:
    """Start ``threads`` together, wait for all of them; the wall seconds that took."""
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0
