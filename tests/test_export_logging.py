"""Exporting under a root logger at INFO (as benchmarks run) logs no INFO lines from the exporter or the
quantizer, and leaves the root logger and the libraries' loggers as it found them."""

from __future__ import annotations

import logging
import subprocess
import sys

import torch

from prunus.export.onnx_export import export_prefill, save_graph
from prunus.export.quantize_onnx import quantize_fp32_graph
from prunus.export.quiet_logs import EXPORT_LOGGERS, quiet_loggers
from prunus.models import Transformer, get_preset


def test_quiet_loggers_is_scoped_to_the_block(caplog):
    caplog.set_level(logging.INFO)
    child = logging.getLogger("onnx_ir.passes.example")
    logging.getLogger("onnxscript").setLevel(logging.DEBUG)  # a level of the caller's own comes back
    try:
        with quiet_loggers():
            child.info("inside")
            child.error("an error still shows")
        child.info("after")
        assert [r.getMessage() for r in caplog.records] == ["an error still shows", "after"]
        assert logging.getLogger("onnxscript").level == logging.DEBUG
        assert logging.getLogger().level == logging.INFO
    finally:
        logging.getLogger("onnxscript").setLevel(logging.NOTSET)


def test_export_and_quantize_log_nothing_under_a_root_logger_at_info(caplog, tmp_path):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    levels = {n: logging.getLogger(n).level for n in EXPORT_LOGGERS}
    caplog.set_level(logging.INFO)
    save_graph(export_prefill(model.eval()), tmp_path / "prefill.onnx", external_data=False)
    quantize_fp32_graph(tmp_path / "prefill.onnx", tmp_path / "int8.onnx")
    assert (tmp_path / "int8.onnx").stat().st_size > 0
    noisy = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno < logging.WARNING]
    assert noisy == [], noisy[:5]
    assert logging.getLogger().level == logging.INFO
    assert {n: logging.getLogger(n).level for n in EXPORT_LOGGERS} == levels


def test_importing_the_quantizer_leaves_the_root_logger_alone():
    """onnxruntime's matmul_nbits_quantizer calls logging.basicConfig(level=INFO) on import; a fresh process
    (nothing imported yet, no handlers: what pytest's own would hide) shows the root logger untouched."""
    code = ("import logging; from prunus.export.quiet_logs import matmul_nbits_quantizer; q = matmul_nbits_quantizer(); "
            "root = logging.getLogger(); print(q.__name__, root.level, len(root.handlers))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["MatMulNBitsQuantizer", str(logging.WARNING), "0"]
