"""ONNX Runtime's own int4 quantizer as a peer: ``MatMulNBitsQuantizer`` with RTN, GPTQ and HQQ on prunus's fp32 graphs.

Used by ``compress_quality.py`` (bits per byte, scored in ONNX Runtime) and ``export_latency.py`` (decode
step). The peer gets the graphs prunus exports in fp32 with the tied output head untied first
(:func:`prunus.export.quantize_onnx.untie_weights`), so it quantizes every MatMul, the head included,
at the bits, group size and symmetry asked for:

* ``rtn``: ``DefaultWeightOnlyQuantConfig`` (round to nearest per block, accuracy level 4);
* ``gptq``: ``GPTQWeightOnlyQuantConfig`` (the vendored neural-compressor GPTQ, accuracy level 4), with a
  calibration reader over prunus's own calibration batches of the same text; it runs the fp32 graph once
  per (MatMul input, batch), so it is given fewer calibration tokens than prunus's GPTQ takes
  (the caller says how many). In onnxruntime 1.31.1 its integers came out byte-identical to its RTN's:
  on every layer of the demo model's graph, and for ``weight_only.gptq`` called directly on a random
  128 x 32 weight with a skewed Hessian then re-quantized by its ``quant_tensor`` as the quantizer does
  (the cause was not traced), so its row measures RTN;
* ``hqq``: ``HQQWeightOnlyQuantConfig`` (float zero points; ONNX Runtime writes no accuracy level, so the
  node computes in float).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch

from prunus.export.quantize_onnx import untie_weights
from prunus.export.quiet_logs import matmul_nbits_quantizer, quiet_loggers
from prunus.runtime.ort_session import ort_session

PEER_ALGORITHMS = ("rtn", "gptq", "hqq")


class BatchReader:
    """An ``onnxruntime.quantization.CalibrationDataReader`` over token batches (rows, seq) for a prefill graph
    whose inputs are input_ids, position_ids and attention_mask."""

    def __init__(self, batches: list[torch.Tensor]):
        self.feeds = [{"input_ids": b.long().numpy(), "position_ids": np.broadcast_to(np.arange(b.shape[1]), b.shape).copy(),
                       "attention_mask": np.ones(b.shape, dtype=np.int64)} for b in batches]
        self.i = 0

    def get_next(self):
        if self.i >= len(self.feeds):
            return None
        self.i += 1
        return self.feeds[self.i - 1]

    def __iter__(self):
        return iter(self.feeds)

    def rewind(self):
        self.i = 0


def _config(algorithm: str, group: int, symmetric: bool, calibration):
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    if algorithm == "rtn":
        return mnq.DefaultWeightOnlyQuantConfig(block_size=group, is_symmetric=symmetric, accuracy_level=4, bits=4)
    if algorithm == "gptq":
        if calibration is None:
            raise ValueError("the gptq peer needs calibration batches")
        return mnq.GPTQWeightOnlyQuantConfig(calibration_data_reader=BatchReader(calibration), percdamp=0.01)
    if algorithm == "hqq":
        return mnq.HQQWeightOnlyQuantConfig(block_size=group, bits=4)
    raise ValueError(f"unknown peer algorithm {algorithm!r}; choose one of {PEER_ALGORITHMS}")


def ort_int4(src: Path, dst: Path, algorithm: str, group: int = 64, symmetric: bool = False,
             calibration: list[torch.Tensor] | None = None) -> Path:
    """``dst``: the fp32 graph ``src`` quantized by ONNX Runtime's MatMulNBitsQuantizer with ``algorithm``."""
    model = onnx.load(str(src))
    untie_weights(model)
    with quiet_loggers():
        quantizer = matmul_nbits_quantizer()(model, bits=4, block_size=group, is_symmetric=symmetric,
                                             accuracy_level=4, op_types_to_quantize=("MatMul",),
                                             algo_config=_config(algorithm, group, symmetric, calibration))
        quantizer.process()
    out = quantizer.model.model if hasattr(quantizer.model, "model") else quantizer.model
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(out, str(dst))
    return dst


def matmulnbits_summary(path: Path) -> str:
    """'N MatMulNBits (bits b, block g, zero points: kind, accuracy level a)' of a graph, to print beside a row."""
    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    if not nodes:
        return "no MatMulNBits"
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    zp = nodes[0].input[3] if len(nodes[0].input) > 3 else ""
    kind = "none" if not zp else ("float" if inits[zp].data_type == onnx.TensorProto.FLOAT else "uint4")
    return (f"{len(nodes)} MatMulNBits (bits {attrs.get('bits')}, block {attrs.get('block_size')}, zero points "
            f"{kind}, accuracy level {attrs.get('accuracy_level', 0)})")


class PrefillLogits:
    """``tokens (batch, seq) -> logits``: a prefill graph (input_ids, position_ids, attention_mask -> logits first)
    in an ONNX Runtime session, to score with ``prunus.data.evaluate``."""

    def __init__(self, path: Path, threads: int | None = None):
        self.session = ort_session(path, threads, spinning=False)
        self.output = self.session.get_outputs()[0].name

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        feeds = {"input_ids": tokens.long().numpy(), "position_ids": np.broadcast_to(np.arange(s), (b, s)).copy(),
                 "attention_mask": np.ones((b, s), dtype=np.int64)}
        return torch.from_numpy(self.session.run([self.output], feeds)[0]).float()


__all__ = ["PEER_ALGORITHMS", "BatchReader", "ort_int4", "matmulnbits_summary", "PrefillLogits"]
