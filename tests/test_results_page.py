"""docs/results.md is generated from the records under docs/results/ (benchmarks.results_page), and a benchmark's
run is recorded with its machine, date, command and tables (benchmarks.record)."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import record as record_mod
from benchmarks import results_page


def test_the_results_page_is_what_its_records_give():
    assert results_page.PAGE.read_text() == results_page.render(results_page.load_records()), (
        "docs/results.md differs from docs/results/*.json: edit the records (or record a run with python -m "
        "benchmarks.record NAME ...), then run python -m benchmarks.results_page")


def test_every_recorded_run_names_its_machine_date_and_command():
    records = results_page.load_records()
    listed = {name for name, _ in records}
    assert listed == {p.stem for p in results_page.RESULTS.glob("*.json")} - {"index"}, "a record no index lists"
    for name, r in records:
        assert set(r) >= {"title", "level", "blocks"}, name
        if "command" in r:
            assert r["machine"]["cpu"] and r["date"] and r["command"].startswith("python -m benchmarks."), name


QUICK = '''"""A quick benchmark for the recorder's test."""
import argparse

from benchmarks.harness import show


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2)
    n = parser.parse_args().n
    show("squares", ["x", "|x| squared"], [[str(i), str(i * i)] for i in range(n)])
    print(f"done: {n} rows")


if __name__ == "__main__":
    main()
'''


@pytest.fixture
def results(tmp_path, monkeypatch):
    package = tmp_path / "pkg" / "fakebench"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "quick.py").write_text(QUICK)
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "index.json").write_text(json.dumps({"order": []}))
    yield folder, tmp_path / "results.md"
    for name in [m for m in sys.modules if m.startswith("fakebench")]:
        del sys.modules[name]


def test_a_recorded_run_keeps_its_tables_command_and_machine_and_a_new_run_keeps_the_notes(results, capsys):
    folder, page = results
    path = record_mod.record("quick", ["--n", "3"], folder, page, package="fakebench")
    body = json.loads(path.read_text())
    assert body["command"] == "python -m fakebench.quick --n 3" and body["title"] == "A quick benchmark for the recorder's test"
    assert body["machine"]["cpu"] and body["date"] and "done: 3 rows" in body["output"]
    assert [b["table"] for b in body["blocks"] if "table" in b] == [
        {"headers": ["x", "\\|x\\| squared"], "rows": [["0", "0"], ["1", "1"], ["2", "4"]]}]  # pipes escaped
    assert json.loads((folder / "index.json").read_text())["order"] == ["quick"]
    text = page.read_text()
    assert "## A quick benchmark" in text and "python -m fakebench.quick --n 3" in text and "| 2 | 4 |" in text
    body["notes"] = "Squares grow."
    path.write_text(json.dumps(body))
    record_mod.record("quick", ["--n", "2"], folder, page, package="fakebench")
    again = json.loads(path.read_text())
    assert again["notes"] == "Squares grow." and again["command"].endswith("--n 2")
    assert "Squares grow." in page.read_text() and "| 2 | 4 |" not in page.read_text()
    assert json.loads((folder / "index.json").read_text())["order"] == ["quick"]
    labelled = record_mod.record("quick@five", ["--n", "5"], folder, page, package="fakebench")
    assert labelled.name == "quick-five.json" and json.loads(path.read_text())["command"].endswith("--n 2")
    assert json.loads((folder / "index.json").read_text())["order"] == ["quick", "quick-five"]


def test_a_failing_benchmark_records_nothing(results):
    folder, page = results
    with pytest.raises(SystemExit):
        record_mod.record("quick", ["--n", "many"], folder, page, package="fakebench")
    assert not (folder / "quick.json").exists() and not page.exists()
