"""NaN and infinity in the float arrays read from an artifact: found in one vectorised pass per tensor, at load.

A weight read from disk is checked once, where it is read (:mod:`prunus.native.weights`, the ONNX initializers of
:mod:`prunus.artifacts.onnx_initializers`), and a tensor holding a NaN or an infinity is one PrunusError line naming
it, the first such element and where it lies. numpy float arrays are tested with ``np.isfinite``; a float type numpy
lacks (bfloat16, float8) is tested on its raw bits as unsigned integers: a value is NaN or infinite when every bit
of ``mask`` is set (its exponent all ones; :data:`RAW_MASKS`). The pass runs in chunks of :data:`CHUNK` elements,
so the temporary mask stays small whatever the tensor's size. numpy only: ``native/`` may import this package.
"""

from __future__ import annotations

import numpy as np

from .errors import PrunusError

CHUNK = 1 << 22  # elements per pass: a 4 MB temporary mask, however large the tensor
FLOAT32_MAX = float(np.finfo(np.float32).max)
# float types numpy has no dtype for, by their raw bits: (unsigned dtype, mask) with bits & mask == mask for NaN
# and infinity (the exponent all ones; float8 e4m3fn has no infinity and one NaN pattern per sign, S.1111.111)
RAW_MASKS = {"bfloat16": (np.dtype("<u2"), 0x7F80), "float8_e4m3fn": (np.dtype("u1"), 0x7F),
             "float8_e5m2": (np.dtype("u1"), 0x7C)}


def first_nonfinite(a: np.ndarray, mask: int | None = None) -> int | None:
    """The flat index of the first NaN or infinity in ``a`` (None: every element finite, or ``a`` holds no
    floats). ``mask``: ``a`` holds the raw bits of a float type numpy lacks (see :data:`RAW_MASKS`)."""
    if mask is None and a.dtype.kind not in "fc":
        return None
    flat = a.reshape(-1)
    for start in range(0, flat.size, CHUNK):
        part = flat[start:start + CHUNK]
        bad = (part & mask) == mask if mask is not None else ~np.isfinite(part)
        if bad.any():
            return start + int(np.argmax(bad))
    return None


def describe(value) -> str:
    """``nan``, ``inf`` or ``-inf`` for a non-finite numpy or Python value; else its short repr."""
    value = float(value)
    return "nan" if value != value else repr(value)


def check_finite(a: np.ndarray, what: str, fix: str, mask: int | None = None) -> None:
    """Nothing when every element of ``a`` is finite; else one PrunusError line "{what} holds nan at element i of
    n; {fix}" (``what`` names the file and the tensor)."""
    i = first_nonfinite(a, mask)
    if i is not None:
        value = "a NaN or an infinity" if mask is not None else describe(a.reshape(-1)[i])
        raise PrunusError(f"{what} holds {value} at element {i} of {a.size}; {fix}")
