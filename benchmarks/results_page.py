"""docs/results.md is generated: every section is a JSON record under ``docs/results/``, in the order
``docs/results/index.json`` lists them, and this renders the page from them.

    python -m benchmarks.results_page          # write docs/results.md from the records
    python -m benchmarks.results_page --check  # exit 1 when the page differs from what the records give

A record is ``{"title", "level", "blocks"}``: a heading (level 2 or 3; 0: none, the page's opening) and blocks,
each ``{"text": markdown}`` or ``{"table": {"headers": [...], "rows": [[...], ...]}}``. A run of a benchmark
recorded by ``python -m benchmarks.record NAME ...`` adds what it was run on and how: ``benchmark``, ``machine``
(:func:`benchmarks.harness.machine`), ``date`` and ``command``, its tables as blocks, its printed output, and
``notes`` (what the figures mean; a person writes them, and a new run of the benchmark keeps them). The sections
written by hand before results were generated keep their machine, date and command in their text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "results.md"
INDEX = "index.json"
OUTPUT_LINES = 80  # the last lines of a run's printed output the page shows


def load_records(results: Path = RESULTS) -> list[tuple[str, dict]]:
    """(name, record) of every record ``index.json`` lists, in its order; a listed record missing is an error."""
    order = json.loads((results / INDEX).read_text())["order"]
    records = []
    for name in order:
        path = results / f"{name}.json"
        if not path.is_file():
            raise SystemExit(f"{results / INDEX} lists {name!r} and {path} does not exist")
        records.append((name, json.loads(path.read_text())))
    return records


def _row(cells: list) -> str:
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def table_lines(table: dict) -> list[str]:
    """A markdown table: the header row, its rule, a line per row."""
    headers = table["headers"]
    return [_row(headers), "|" + "---|" * len(headers)] + [_row(row) for row in table["rows"]]


def _run_lines(record: dict) -> list[str]:
    """What a recorded run adds under its heading: where and how it ran, then the notes."""
    m = record["machine"]
    torch = f", torch {m['torch']} ({m['torch_threads']} threads)" if m.get("torch") else ""
    lines = ["", f"Recorded {record['date']} by `python -m benchmarks.record`, on {m['cpu']} ({m['cpu_threads']} CPU "
                 f"threads{torch}, OMP_WAIT_POLICY={m.get('omp_wait_policy')}):", "", f"    {record['command']}"]
    if record.get("notes"):
        lines += ["", *record["notes"].rstrip("\n").split("\n")]
    return lines


TITLE_PIECE = 12  # the shortest printed line taken for a piece of a table's title
BOX = set("┏┃┡│└┗╇━┳┓┩┛┠┨")  # the characters of a table as the terminal shows it (its figures are the blocks)


def _output_lines(output: str, titles: list[str]) -> list[str]:
    """The printed output's last lines, without the tables the record already holds (their boxes and titles)."""
    def shown(line: str) -> bool:  # a box line, or a wrapped piece of a table's title (long enough to tell)
        text = line.strip()
        return text[:1] in BOX or len(text) >= TITLE_PIECE and any(text in t for t in titles)

    kept = [line for line in output.rstrip("\n").split("\n") if not shown(line)]
    tail = kept[-OUTPUT_LINES:]
    return ["", "<details><summary>printed output</summary>", "", "```text", *tail, "```", "", "</details>"]


def record_lines(record: dict) -> list[str]:
    lines = ["#" * record["level"] + " " + record["title"]] if record.get("level") else []
    if "command" in record:  # a recorded run follows the page's last line: a blank line first
        lines.insert(0, "")
        lines += _run_lines(record)
    for block in record["blocks"]:
        if "text" in block:
            lines += block["text"].split("\n")
        else:
            lines += table_lines(block["table"])
    if record.get("output"):
        lines += _output_lines(record["output"], record.get("shown_titles", []))
    if "command" in record:
        lines.append("")
    return lines


def render(records: list[tuple[str, dict]]) -> str:
    return "\n".join(line for _, record in records for line in record_lines(record)) + "\n"


def write_page(results: Path = RESULTS, page: Path = PAGE) -> Path:
    text = render(load_records(results))
    tmp = page.with_name(page.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(page)
    return page


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="Exit 1 when docs/results.md is not what the records give.")
    args = parser.parse_args(argv)
    if args.check:
        same = PAGE.read_text() == render(load_records())
        print(f"{PAGE}: {'up to date' if same else 'differs from its records; run python -m benchmarks.results_page'}")
        return 0 if same else 1
    print(f"wrote {write_page()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
