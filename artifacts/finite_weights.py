"""Whether the float weights of an artifact's files are finite, file by file: ONNX graphs' initializers (by the
rules of :func:`prunus.artifacts.onnx_initializers.check_initializers`, inline or external data) and safetensors
tensors. A cache entry whose files hash as its manifest records but whose weights hold a NaN or an infinity
(re-hashed after a change) is not served.

Cheap: every file is read in place as a memory map (the page cache is usually warm from the hash check just
before), in one vectorised pass per tensor (:mod:`prunus.artifacts.finite_arrays`), with no copy of a graph.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import PrunusError
from .finite_arrays import RAW_MASKS, first_nonfinite
from .safetensors_header import read_layout

# safetensors dtypes holding floats: (the dtype their bytes are read as, the raw-bit mask of a type numpy lacks)
_ST_FLOATS = {"F64": (np.dtype("<f8"), None), "F32": (np.dtype("<f4"), None), "F16": (np.dtype("<f2"), None),
              "BF16": RAW_MASKS["bfloat16"], "F8_E4M3": RAW_MASKS["float8_e4m3fn"],
              "F8_E5M2": RAW_MASKS["float8_e5m2"]}


def safetensors_nonfinite(path: Path) -> str | None:
    """The first float tensor of safetensors file ``path`` holding a NaN or an infinity, or None."""
    header, _, start = read_layout(path, fix="it is rebuilt")
    floats = [(name, e) for name, e in header.items() if e["dtype"] in _ST_FLOATS]
    if not floats:
        return None
    data = np.memmap(path, np.uint8, "r")
    for name, entry in floats:
        a, b = entry["data_offsets"]
        dtype, mask = _ST_FLOATS[entry["dtype"]]
        if first_nonfinite(data[start + a:start + b].view(dtype), mask) is not None:
            return name
    return None


def nonfinite_weights(directory: Path, names) -> str | None:
    """Why the weights among files ``names`` of ``directory`` are not all finite (``"FILE: ..."``, naming the
    tensor), or None when they are. ONNX graphs and safetensors files are read; other files are skipped."""
    from .onnx_initializers import check_initializers

    for name in names:
        path = Path(directory) / name
        if name.endswith(".onnx"):
            try:
                check_initializers(path)
            except PrunusError as e:
                return f"{name}: {str(e).split('; ')[0].removeprefix(f'{path}: ')}"
        elif name.endswith(".safetensors"):
            tensor = safetensors_nonfinite(path)
            if tensor is not None:
                return f"{name}: {tensor} holds NaN or infinity"
    return None
