"""An ONNX graph's initializers checked before ONNX Runtime loads it: no NaN or infinity in its weights.

Every float initializer (float32, float16, float64, bfloat16, float8) is read in place, inline in the graph's file or
in its external data file (both memory-mapped, found by :mod:`prunus.artifacts.onnx_wire`; an external name resolved
inside the graph's dir, its byte range checked against the file), in one vectorised pass
(:mod:`prunus.artifacts.finite_arrays`):

* a tensor of rank one or more (a weight, a bias, a norm, a table) must be finite;
* a quantization scale (the scale inputs of ``QuantizeLinear``, ``DequantizeLinear``, ``MatMulNBits``,
  ``DynamicQuantizeMatMul`` and the other quantized operators of :data:`SCALES`) must be finite whatever its rank,
  and positive where the operator divides by it (``QuantizeLinear``'s ``y_scale``);
* a rank-0 initializer that is no scale is a constant of the graph's arithmetic, not a weight: ``torch.onnx.export``
  writes a module's ``masked_fill(mask, float("-inf"))`` or ``clamp(max=inf)`` as one, so it is left as written.

A damaged initializer is one PrunusError line naming the graph, the tensor and its first bad element.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .contained import inside
from .errors import PrunusError
from .finite_arrays import RAW_MASKS, check_finite
from .onnx_wire import Tensor, WireError, graphs
from .validate import short

EXTERNAL = 1  # TensorProto.data_location
FIX = "the graph's weights are damaged; re-export it from a model dir whose weights are finite (prunus export)"
# ONNX TensorProto data types -> (numpy dtype of the stored bytes, raw-bit mask or None for a numpy float)
FLOATS = {1: (np.dtype("<f4"), None), 10: (np.dtype("<f2"), None), 11: (np.dtype("<f8"), None),
          16: RAW_MASKS["bfloat16"], 17: RAW_MASKS["float8_e4m3fn"], 19: RAW_MASKS["float8_e5m2"]}
# operator -> (inputs that are scales, the ones it divides by)
SCALES = {"QuantizeLinear": ((1,), (1,)), "DequantizeLinear": ((1,), ()), "MatMulNBits": ((2,), ()),
          "DynamicQuantizeMatMul": ((2,), ()), "MatMulIntegerToFloat": ((2, 3), ()),
          "GatherBlockQuantized": ((2,), ()), "QLinearMatMul": ((1, 4, 6), (1, 4, 6)),
          "QLinearConv": ((1, 4, 6), (1, 4, 6))}


def _scales(nodes: list[tuple[str, list[str]]]) -> dict[str, bool]:
    """{initializer name: whether an operator divides by it} of the scale inputs of a graph's nodes."""
    out: dict[str, bool] = {}
    for op, inputs in nodes:
        scales, divisors = SCALES.get(op, ((), ()))
        for i in scales:
            if i < len(inputs) and inputs[i]:
                out[inputs[i]] = out.get(inputs[i], False) or i in divisors
    return out


class _External:
    """The external data files of one graph, each memory-mapped once."""

    def __init__(self, graph_path: Path | None):
        self.base, self.maps = (graph_path.parent if graph_path is not None else None), {}

    def array(self, t: Tensor, where: str, dtype: np.dtype, count: int) -> np.ndarray:
        if self.base is None:
            raise PrunusError(f"{where}: its data is external, and a graph given as bytes has no dir to read it from; "
                              "give the graph's path")
        info = t.external
        file = inside(self.base, info.get("location"), f"{where}'s external data", fix=FIX)
        try:
            offset, length = int(info.get("offset", "0")), int(info.get("length", str(count * dtype.itemsize)))
        except ValueError:
            offset = length = -1
        if file not in self.maps:
            self.maps[file] = _map(file)
        whole = self.maps[file]
        if offset < 0 or length != count * dtype.itemsize or offset + length > whole.size:
            raise PrunusError(f"{where}: its external data (offset {short(info.get('offset'))}, length "
                              f"{short(info.get('length'))}) is not {count} values inside {file.name} "
                              f"({whole.size} bytes); re-create the export dir with prunus export")
        return whole[offset:offset + length].view(dtype)


def _map(file: Path) -> np.ndarray:
    """The bytes of ``file``, memory-mapped read-only (an empty file: no bytes)."""
    return np.memmap(file, np.uint8, "r") if file.stat().st_size else np.zeros(0, np.uint8)


def _values(buf: np.ndarray, t: Tensor, where: str, external: _External) -> tuple[np.ndarray, int | None] | None:
    """(the stored values of initializer ``t`` as their numpy dtype or raw bits, the raw-bit mask), or None for a
    tensor that holds no floats. Inline data is a view of ``buf``; data in the typed fields (``float_data``,
    ``int32_data``: small tensors) is read by onnx from the tensor's own message."""
    if t.data_type not in FLOATS:
        return None
    dtype, mask = FLOATS[t.data_type]
    count = math.prod(t.dims)
    if t.location == EXTERNAL:
        return (external.array(t, where, dtype, count) if count else np.zeros(0, dtype)), mask
    if t.raw is not None:
        start, end = t.raw
        if end - start != count * dtype.itemsize:
            raise PrunusError(f"{where}: holds {end - start} bytes for {count} values; re-create the export dir with "
                              "prunus export")
        return buf[start:end].view(dtype), mask
    from onnx import TensorProto, numpy_helper

    try:
        values = numpy_helper.to_array(TensorProto.FromString(bytes(buf[t.span[0]:t.span[1]])))
    except Exception as e:  # noqa: BLE001 - protobuf's and numpy's own errors for a tensor that does not decode
        raise PrunusError(f"{where}: its values do not decode ({type(e).__name__}: {' '.join(str(e).split())[:120]}); "
                          "re-create the export dir with prunus export") from None
    return np.ascontiguousarray(values).reshape(-1).view(dtype), mask


def _check_tensor(buf, t: Tensor, where: str, divided: bool | None, external: _External) -> None:
    """One initializer against the rules of the module docstring (``divided``: None for no scale, else whether an
    operator divides by it)."""
    found = _values(buf, t, where, external)
    if found is None:
        return
    values, mask = found
    check_finite(values, where, FIX, mask)
    if divided and mask is None and values.size and not bool((values > 0).all()):
        i = int(np.argmax(~(values > 0)))
        raise PrunusError(f"{where} holds {float(values[i]):g} at element {i}, a scale the graph divides by, which "
                          f"must be positive; {FIX}")


def check_initializers(path: str | Path | bytes, name: str | None = None) -> None:
    """Every initializer of the graph at ``path`` (a file, or a serialized graph's bytes), and of its subgraphs,
    against the rules of the module docstring, read in place (:mod:`prunus.artifacts.onnx_wire`); ``name``: how
    errors name the graph (default its path)."""
    file = None if isinstance(path, bytes) else Path(path)
    name = name or ("the ONNX graph" if file is None else str(file))
    buf = np.frombuffer(path, np.uint8) if file is None else _map(file)
    external = _External(file)
    try:
        for graph in graphs(memoryview(buf)):
            scales = _scales(graph.nodes)
            for t in graph.tensors:
                if t.dims or t.name in scales:  # a rank-0 tensor that is no scale: a constant (module docstring)
                    _check_tensor(buf, t, f"{name}: initializer {short(t.name, 120)}", scales.get(t.name), external)
    except WireError as e:
        raise PrunusError(f"{name}: not a readable ONNX graph ({e}); re-create the export dir with prunus "
                          "export") from None
