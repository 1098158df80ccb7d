"""Other libraries' loggers kept quiet while prunus exports, for the length of the call that needs it.

The dynamo exporter's passes (loggers under ``onnxscript`` and ``onnx_ir``) log INFO lines per
pass and per graph, ``torch.onnx`` its progress and warnings we do not act on, and ONNX Runtime's
``MatMulNBitsQuantizer`` two lines per node it rewrites. Under a root logger at INFO (a
benchmark's, or the one that quantizer's module sets up on import, see
:func:`matmul_nbits_quantizer`) the prefill graph of the tiny preset alone logged 43 INFO lines. :func:`quiet_loggers` raises those libraries' loggers (by name, so their child
loggers follow) and restores their levels afterwards; the root logger and every handler are left
as the caller set them.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

EXPORT_LOGGERS = ("torch.onnx", "onnxscript", "onnx_ir", "onnxruntime")


@contextmanager
def quiet_loggers(names: tuple[str, ...] = EXPORT_LOGGERS, level: int = logging.ERROR):
    """Within the block the loggers ``names`` (and their children that set no level) pass only ``level``
    and above; their own levels are restored on the way out, even on an exception."""
    loggers = [logging.getLogger(n) for n in names]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, old in zip(loggers, saved):
            lg.setLevel(old)


def matmul_nbits_quantizer():
    """ONNX Runtime's ``MatMulNBitsQuantizer`` class, imported without its import-time logging setup.

    Its module calls ``logging.basicConfig(level=INFO)`` when first imported (onnxruntime 1.31): on a
    root logger with no handler yet, that gives the whole process a stderr handler and an INFO level.
    A ``NullHandler`` held on the root logger during the import makes that call a no-op; afterwards the
    root logger's level and handlers are what they were."""
    root = logging.getLogger()
    guard = logging.NullHandler()
    root.addHandler(guard)
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    finally:
        root.removeHandler(guard)
    return MatMulNBitsQuantizer
