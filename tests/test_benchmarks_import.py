"""benchmarks/ is a dev package run from the repository root as ``python -m benchmarks.NAME``: every benchmark
imports (its main is not run) with no path lines, a module run from the root finds the package, and the harness
measures and reports without torch."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# needs llama-cpp-python, which runs in an interpreter of its own
NEEDS = {"_llamacpp_worker": "llama_cpp"}


@pytest.fixture
def benchmarks(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    # benchmarks set OMP_WAIT_POLICY when imported; keep this process's setting as it was
    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    return importlib.import_module("benchmarks")


def test_every_benchmark_imports(benchmarks):
    names = [m.name for m in pkgutil.iter_modules(benchmarks.__path__)]
    assert {"harness", "train_throughput", "serve_throughput", "compress_quality"} <= set(names)
    for name in names:
        if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
            continue
        module = importlib.import_module(f"benchmarks.{name}")
        assert module.__name__ == f"benchmarks.{name}"
    scripts = [p.stem for p in (ROOT / "benchmarks").glob("[a-z]*.py") if p.stem != "harness"]
    for name in scripts:
        assert callable(getattr(sys.modules[f"benchmarks.{name}"], "main", None)), f"benchmarks/{name}.py has no main"


def test_no_path_lines_in_benchmarks():
    for path in (ROOT / "benchmarks").glob("*.py"):
        text = path.read_text()
        assert "noqa: E402" not in text and "_bootstrap" not in text, path.name  # imports at the top, no path set-up
        if path.name != "code_before_after.py":  # it puts an earlier worktree first, to time that tree's code
            assert "sys.path" not in text, path.name


def test_a_module_run_from_the_root_finds_the_package_and_the_harness_needs_no_torch():
    run = subprocess.run([sys.executable, "-m", "benchmarks._llamacpp_peer"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    probe = "import sys, benchmarks.harness; print(json.dumps(sorted({'torch', 'numpy', 'rich'} & set(sys.modules))))"
    run = subprocess.run([sys.executable, "-c", "import json; " + probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout) == []


def test_harness_rounds_spreads_and_results(benchmarks, tmp_path):
    from benchmarks import harness

    calls = []

    def contender(name, value):
        return lambda: calls.append(name) or value

    got = harness.alternating_rounds({"ours": contender("ours", 2.0), "peer": contender("peer", None)}, rounds=3)
    assert calls == ["ours", "peer", "peer", "ours", "ours", "peer"]  # the order flips each round
    assert got == {"ours": [2.0, 2.0, 2.0], "peer": []}  # a failed contender adds nothing
    assert harness.median_range([3.0, 1.0, 2.0]) == "2.0 (1.0-3.0)"
    assert harness.median_range([]) == "failed"
    assert harness.median_ratio([2.0, 2.1], [1.0, 1.1]) == "1.952"
    assert harness.median_ratio([1.0, 2.0], [1.5, 2.5]).startswith("≈")
    line = harness.ratio_line("prunus", [200.0, 210.0], "torch", [100.0, 100.0], "tokens/s", "goal >= 0.95")
    assert line.splitlines()[-1] == "ratio prunus / torch: 2.050  (goal >= 0.95)"
    assert harness.machine_line().startswith("machine: ") and "OMP_WAIT_POLICY=" in harness.machine_line()
    out = harness.write_results(tmp_path / "a" / "r.json", {"steps": 2}, {"ours": got["ours"]})
    body = json.loads(out.read_text())
    assert body["settings"] == {"steps": 2} and body["results"]["ours"] == [2.0, 2.0, 2.0]
    assert body["machine"]["cpu_threads"] == os.cpu_count() and body["machine"]["cpu"]
    assert not (tmp_path / "a" / "r.json.tmp").exists()
