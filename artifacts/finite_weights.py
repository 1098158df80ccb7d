"""Whether the float weights an artifact stores are all finite: ONNX graphs' initializers (inline or external
data) and safetensors tensors. A cache entry whose files hash as its manifest records but whose weights hold a
NaN or an infinity (re-hashed after a change) is not served.

Cheap: the bytes are read as memory maps (the OS's page cache, usually warm from the hash check just before),
in chunks of :data:`CHUNK` values, with ``np.isfinite`` (bfloat16, which numpy lacks, on its exponent bits).
float8 kinds are not tested (their NaN is one code and they have no infinity); integer codes are always finite.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from .contained import inside
from .errors import PrunusError
from .safetensors_header import read_layout

CHUNK = 1 << 22  # values per test: 16 MiB of float32 at a time
_FLOATS = {"F64": np.float64, "F32": np.float32, "F16": np.float16}  # tested with np.isfinite
_BITS = {"BF16": (np.uint16, 0x7F80)}  # no numpy type: NaN / infinity when the exponent bits are all ones
_ST_KINDS = (*_FLOATS, *_BITS)
_ONNX_KINDS = {1: "F32", 10: "F16", 11: "F64", 16: "BF16"}  # onnx.TensorProto data types


def _finite_values(data, kind: str) -> bool:
    """True when every ``kind`` value stored in ``data`` (bytes-like, or an array holding the values or, for a
    16-bit kind, their bits) is finite."""
    if kind in _BITS:
        dtype, mask = _BITS[kind]
        words = data.astype(dtype, copy=False) if isinstance(data, np.ndarray) else np.frombuffer(data, dtype)
        return not any(np.any((words[i:i + CHUNK] & dtype(mask)) == dtype(mask)) for i in range(0, words.size, CHUNK))
    if isinstance(data, np.ndarray):
        values = data.astype(np.uint16, copy=False).view(np.float16) if kind == "F16" else data
    else:
        values = np.frombuffer(data, _FLOATS[kind])
    return all(np.isfinite(values[i:i + CHUNK]).all() for i in range(0, values.size, CHUNK))


def _mapped(path: Path):
    """A read-only memory map of ``path`` (None for an empty file)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None


def safetensors_nonfinite(path: Path) -> str | None:
    """The first float tensor of safetensors file ``path`` holding a NaN or an infinity, or None."""
    header, _, start = read_layout(path, fix="it is rebuilt")
    floats = [(name, e) for name, e in header.items() if e["dtype"] in _ST_KINDS]
    if not floats:
        return None
    view = memoryview(_mapped(path))
    for name, entry in floats:
        a, b = entry["data_offsets"]
        if not _finite_values(view[start + a:start + b], entry["dtype"]):
            return name
    return None


def _tensors(graph):
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t


def _onnx_values(tensor, directory: Path, maps: dict):
    """The stored bits of one float tensor: its inline bytes, its external data, or its typed field."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    if uses_external_data(tensor):
        info = ExternalDataInfo(tensor)
        f = inside(directory, info.location, f"{tensor.name}'s external data", fix="it is rebuilt")
        if f not in maps:
            maps[f] = _mapped(f)
        size = len(maps[f]) if maps[f] is not None else 0
        offset, length = int(info.offset or 0), info.length
        length = size - offset if length is None else int(length)
        if not 0 <= offset <= offset + length <= size:
            raise PrunusError(f"{f}: {tensor.name}'s external data lies outside the file; it is rebuilt")
        return memoryview(maps[f])[offset:offset + length] if length else b""
    if tensor.raw_data:
        return tensor.raw_data
    kind = _ONNX_KINDS[tensor.data_type]
    if kind == "F32":
        return np.asarray(tensor.float_data, dtype=np.float32)
    if kind == "F64":
        return np.asarray(tensor.double_data, dtype=np.float64)
    return np.asarray(tensor.int32_data, dtype=np.uint32)  # float16 / bfloat16 bits in the low half


def onnx_nonfinite(path: Path) -> str | None:
    """The first float initializer (or Constant) of ONNX graph ``path`` holding a NaN or an infinity, or None.
    External data files are read only inside the graph's dir."""
    import onnx

    data = _mapped(path)  # parsed from the map: no copy of the file read first (onnx.load reads it whole)
    model = onnx.ModelProto()
    try:
        model.ParseFromString(memoryview(data) if data is not None else b"")
    except Exception as e:  # noqa: BLE001 - a file protobuf cannot parse
        raise PrunusError(f"{path}: not an ONNX graph ({str(e)[:80]}); it is rebuilt") from None
    maps: dict = {}
    for tensor in _tensors(model.graph):
        kind = _ONNX_KINDS.get(tensor.data_type)
        if kind is not None and not _finite_values(_onnx_values(tensor, path.parent, maps), kind):
            return tensor.name
    return None


def nonfinite_weights(directory: Path, names) -> str | None:
    """``"FILE: TENSOR"`` for the first tensor among files ``names`` of ``directory`` (ONNX graphs and safetensors
    files; others are skipped) holding a NaN or an infinity, or None when all are finite."""
    for name in names:
        check = onnx_nonfinite if name.endswith(".onnx") else safetensors_nonfinite if name.endswith(
            ".safetensors") else None
        if check is not None:
            tensor = check(Path(directory) / name)
            if tensor is not None:
                return f"{name}: {tensor}"
    return None
