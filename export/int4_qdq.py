"""Stored int4 weights as blocked QDQ for TensorRT: ``DequantizeLinear`` (opset 21, ``block_size``) -> ``MatMul``.

TensorRT takes int4 only as weight-only, symmetric, explicit quantization: a ``DequantizeLinear`` on a
constant INT4 weight with one scale per block, feeding a ``MatMul``; its IDequantizeLayer accepts no
non-zero zero point. An ``Int4Linear`` (see :mod:`prunus.models.int4`) stores q in [0, 15] with
W = (q - z) * s per group of ``group_size`` input features, so:

* symmetric modules (z = 8 everywhere) write the signed values q - 8 as an INT4 initializer and no zero
  point: the same grid, the form TensorRT parses;
* asymmetric modules write q as UINT4 with their UINT4 zero points. The graph is valid ONNX and ONNX
  Runtime runs it, but TensorRT refuses it (``check_tensorrt_int4`` says so before any work is done).

The weight is laid out as MatMul's right operand, (in, out) = (K, N), blocked along axis 0; scales and
zero points are (K / group_size, N). ONNX packs 4-bit tensors two per byte in row-major order, low
nibble first, so the (K, N) layout is repacked from the module's (N, K / 2) bytes; the integers are the
module's own, never re-quantized.
"""

from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto, helper, numpy_helper

from prunus.artifacts.errors import PrunusError
from prunus.models.int4 import SYMMETRIC_ZERO

from .int4_float_zero import add_group_term, integer_zero

INT4_OPSET = 21  # the first opset with INT4 / UINT4 and blocked DequantizeLinear


def int4_tensor(name: str, values: np.ndarray, signed: bool) -> TensorProto:
    """An INT4 (``signed``) or UINT4 initializer holding integer ``values`` (any shape), packed as ONNX packs
    4-bit tensors: the flattened values two per byte, the even one in the low nibble, an odd count padded."""
    lo, hi = (-8, 7) if signed else (0, 15)
    flat = np.asarray(values, dtype=np.int64).reshape(-1)
    if flat.size and (flat.min() < lo or flat.max() > hi):
        raise ValueError(f"{name}: values outside [{lo}, {hi}]")
    nibbles = (flat & 0x0F).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    proto = TensorProto()
    proto.name, proto.data_type = name, TensorProto.INT4 if signed else TensorProto.UINT4
    proto.dims.extend(np.shape(values))
    proto.raw_data = (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()
    return proto


def int4_qdq_nodes(a: str, outputs: list[str], prefix: str, module) -> tuple[list, list]:
    """``MatMul(a, DequantizeLinear(weight, scale[, zero_point], axis=0, block_size=group))`` for an
    Int4Linear; returns (nodes, initializers). The MatMul writes ``outputs`` (the float MatMul's)."""
    q = module.unpacked().to(torch.int64).t().contiguous().numpy()  # (K, N), values in [0, 15]
    scale = module.weight_scale.float().t().contiguous().numpy()  # (K / group, N)
    zero, term = integer_zero(module)
    if module.symmetric:
        inits = [int4_tensor(f"{prefix}.weight_q4", q - SYMMETRIC_ZERO, signed=True),
                 numpy_helper.from_array(scale, f"{prefix}.weight_scale")]
    else:
        inits = [int4_tensor(f"{prefix}.weight_q4", q, signed=False),
                 numpy_helper.from_array(scale, f"{prefix}.weight_scale"),
                 int4_tensor(f"{prefix}.weight_zero_point", zero.to(torch.int64).t().contiguous().numpy(), signed=False)]
    dq = helper.make_node("DequantizeLinear", [i.name for i in inits], [f"{prefix}.weight_dq"],
                          name=f"{prefix}.weight_dequantize", axis=0, block_size=int(module.group_size))
    y = list(outputs) if term is None else [f"{prefix}.matmul_int_zero"]
    mm = helper.make_node("MatMul", [a, dq.output[0]], y, name=f"{prefix}.matmul")
    if term is None:
        return [dq, mm], inits
    nodes, more = add_group_term(a, y[0], list(outputs), prefix, module, term)
    return [dq, mm, *nodes], inits + more


def check_tensorrt_int4(modules: dict, model_dir) -> None:
    """PrunusError unless every int4 module of ``modules`` is symmetric (TensorRT takes no zero points)."""
    asym = [n for n, m in modules.items() if m.scheme.startswith("int4") and not m.symmetric]
    if asym:
        raise PrunusError(f"{model_dir}: {len(asym)} int4 layer(s) ({asym[0]}, ...) are asymmetric, and "
                          "TensorRT's DequantizeLinear takes no zero points; compress with symmetric int4 for "
                          "--format tensorrt, or use --format onnx")


__all__ = ["INT4_OPSET", "int4_tensor", "int4_qdq_nodes", "check_tensorrt_int4"]
