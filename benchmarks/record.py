"""Run a benchmark and keep its results on the results page: ``docs/results/NAME.json``, then docs/results.md
regenerated (:mod:`benchmarks.results_page`).

    python -m benchmarks.record NAME[@LABEL] [ARGS...]

runs ``python -m benchmarks.NAME ARGS...`` in this process and records the machine (:func:`benchmarks.harness
.machine`), the date, the command, every table it showed (:func:`benchmarks.harness.show`) and the last lines it
printed. A record of the same benchmark is replaced; its ``title`` and ``notes`` (what the figures mean, written by a
person) are kept. ``NAME@LABEL`` keeps a run of its own per label (``docs/results/NAME-LABEL.json``): the same
benchmark on different models or settings. A benchmark that fails records nothing.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import json
import runpy
import shlex
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.results_page import INDEX, PAGE, RESULTS, write_page


class _Tee(io.TextIOBase):
    """What is printed goes to the terminal and is kept."""

    def __init__(self, out):
        self.out, self.kept = out, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def run_benchmark(module: str, args: list[str]) -> tuple[list[dict], str]:
    """(the tables it showed, what it printed) of ``python -m MODULE ARGS``, run in this process."""
    harness.SHOWN.clear()
    argv, stdout = sys.argv, sys.stdout
    sys.argv, sys.stdout = [module, *args], _Tee(sys.stdout)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    finally:
        printed, sys.stdout, sys.argv = sys.stdout.kept.getvalue(), stdout, argv
    return list(harness.SHOWN), printed


def _cell(text: str) -> str:
    """A table cell as markdown reads it: one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def make_record(module: str, args: list[str], tables: list[dict], printed: str, earlier: dict | None) -> dict:
    """The record of a run: the earlier record's title and notes, this run's machine, date, command and figures."""
    spec = importlib.util.find_spec(module)
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) if spec and spec.origin else None
    first = " ".join((doc or module).strip().split("\n\n")[0].split())
    title = (earlier or {}).get("title") or re.split(r"(?<=[.?!]) ", first)[0].rstrip(".")
    blocks = []
    for t in tables:
        caption = " ".join(t["title"].split())
        cells = {"headers": [_cell(h) for h in t["headers"]], "rows": [[_cell(c) for c in r] for r in t["rows"]]}
        blocks += [{"text": f"\n**{caption}**\n"}, {"table": cells}]
    return {"title": title, "level": (earlier or {}).get("level", 2), "benchmark": module,
            "machine": harness.machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python -m " + shlex.join([module, *args]), "notes": (earlier or {}).get("notes", ""),
            "blocks": blocks, "shown_titles": [t["title"] for t in tables], "output": printed}


def record(name: str, args: list[str], results: Path = RESULTS, page: Path = PAGE, package: str = "benchmarks") -> Path:
    """Run ``package.name`` (``name@label``: its own record per label) with ``args``, write its record and the page;
    the record's path."""
    benchmark, _, label = name.partition("@")
    name = f"{benchmark}-{label}" if label else benchmark
    module = f"{package}.{benchmark}"
    tables, printed = run_benchmark(module, args)
    path = results / f"{name}.json"
    earlier = json.loads(path.read_text()) if path.is_file() else None
    body = make_record(module, args, tables, printed, earlier)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1, ensure_ascii=False, default=str) + "\n")
    tmp.replace(path)
    index = json.loads((results / INDEX).read_text())
    if name not in index["order"]:
        index["order"].append(name)
        (results / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    write_page(results, page)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip().split("\n\n")[1].strip())
        return 2
    path = record(argv[0], argv[1:])
    print(f"recorded {path}; wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
