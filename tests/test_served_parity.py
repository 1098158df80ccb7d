"""Parity of what is served: a genai export is checked in ONNX Runtime and in the native kernels on this CPU's path,
with the same limits; kernels that fail theirs are not what ``native="auto"`` serves, and ``prunus info`` and the
engine's info show each runtime's figures. Skipped with the reason where the native kernels cannot run here."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from prunus.cli.main import cli
from prunus.export import export_model
from prunus.native.build import isa, unavailable
from prunus.serve import Engine

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"native kernels unavailable: {WHY}")


@pytest.fixture(scope="module")
def exports(trained_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    for precision in ("fp32", "int8", "int4"):
        export_model(trained_run / "model", root / precision, precision=precision, progress=False)
    return root


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])
def test_both_runtimes_are_checked_with_the_same_limits(exports, precision):
    report = json.loads((exports / precision / "parity.json").read_text())
    ort, native = report["runtimes"]["onnxruntime"], report["runtimes"]["native"]
    assert ort["passed"] and native["passed"] and native["checked"]
    assert native["tolerances"] == ort["tolerances"] == report["tolerances"]
    assert native["isa"] == isa()
    for key in ("top1_agreement", "decode_agreement", "greedy_agreement", "bpb_increase", "max_abs_logits"):
        assert isinstance(native[key], float), key
    assert ort["top1_agreement"] == report["top1_agreement"]  # the top level is ONNX Runtime's report
    if precision == "fp32":
        assert native["max_abs_logits"] < 1e-3 and native["greedy_agreement"] == 1.0
        assert native["activations"] == "float32"
    else:
        assert native["activations"].startswith("int8 per row")


def test_the_engine_says_what_the_check_of_its_kernels_found(exports):
    with Engine.load(exports / "int8", max_batch=2, max_len=64) as engine:
        assert engine.info["runtime"] == "native"
        assert engine.info["native_parity"].startswith(f"passed on {isa()} (top-1 ")


def test_info_shows_each_runtimes_figures(exports):
    r = CliRunner().invoke(cli, ["info", str(exports / "int4")], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    table = r.output[r.output.index("parity against PyTorch, per runtime"):]
    header = next(line for line in table.splitlines() if "onnxruntime" in line)
    assert "native" in header
    assert "top-1 agreement" in table and "decode agreement" in table and "bits/byte increase" in table
    assert isa() in next(line for line in table.splitlines() if "kernel path" in line)
    assert "passed" in next(line for line in table.splitlines() if "verdict" in line)


class _Noisy:
    """The native kernels' parity graphs with their logits pushed off PyTorch's (as kernels with a wrong answer)."""

    def __init__(self, graphs):
        self.graphs = graphs

    def __call__(self, tokens):
        logits = self.graphs(tokens)
        return logits + 50 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))

    def greedy(self, prompt, n, attention_mask=None, follow=None):
        out = self.graphs.greedy(prompt, n, attention_mask, follow)
        return (out + 1) % 256

    def close(self):
        self.graphs.close()


def test_kernels_that_fail_their_check_are_not_what_serves(trained_run, tmp_path, monkeypatch):
    """The export is written (ONNX Runtime passes), the kernels' record says they failed, and native="auto" serves
    it in ONNX Runtime with the reason; the tokens are ONNX Runtime's."""
    from prunus.export import served_parity

    real = served_parity.native_graphs
    monkeypatch.setattr(served_parity, "native_graphs", lambda *a, **k: _Noisy(real(*a, **k)))
    export_model(trained_run / "model", tmp_path / "e", precision="int8", progress=False)
    report = json.loads((tmp_path / "e" / "parity.json").read_text())
    assert report["passed"] and report["runtimes"]["onnxruntime"]["passed"]
    native = report["runtimes"]["native"]
    assert native["passed"] is False and "top1_agreement" in native["failed"]
    with Engine.load(tmp_path / "e", max_batch=2, max_len=64) as engine:
        assert engine.info["runtime"] == "ort_genai"
        assert "parity check failed on the native kernels" in engine.info["native"]
        assert engine.info["native_parity"].startswith("FAILED on")
        got = engine.wait(engine.submit([5, 6, 7], 8, temperature=0.0, ignore_eos=True)).token_ids
    with Engine.load(tmp_path / "e", max_batch=2, max_len=64, native=False) as engine:
        assert engine.wait(engine.submit([5, 6, 7], 8, temperature=0.0, ignore_eos=True)).token_ids == got
    r = CliRunner().invoke(cli, ["info", str(tmp_path / "e")], env={"COLUMNS": "250"})
    verdict = next(line for line in r.output.splitlines() if "verdict" in line)
    assert "passed" in verdict and "FAILED: " in verdict and "top1_agreement" in verdict


def test_export_prints_each_runtimes_figures(trained_run, tmp_path):
    """`prunus export` shows the check of every runtime that may serve the export, not ONNX Runtime's alone."""
    out = tmp_path / "int8"
    r = CliRunner().invoke(cli, ["export", str(trained_run / "model"), "--out", str(out), "--precision", "int8"],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    table = r.output[r.output.index("parity against PyTorch, per runtime"):]
    assert "native" in next(line for line in table.splitlines() if "onnxruntime" in line)
    assert isa() in next(line for line in table.splitlines() if "kernel path" in line)
