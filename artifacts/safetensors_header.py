"""The safetensors header, checked before any tensor is read: the validator of ``model.safetensors``.

A file is an 8-byte little-endian header length, a JSON header (tensor name -> dtype, shape,
data offsets; an optional ``__metadata__`` of strings) and the data. :func:`read_header` refuses a
header length beyond the file or above :data:`MAX_HEADER_BYTES`, a header that is not a UTF-8 JSON
object of that shape, tensors whose bytes lie outside the file or disagree with their dtype and
shape, and offsets that do not tile the data exactly (a gap, an overlap, bytes after the last
tensor): every file the safetensors library would refuse is one line here first. :func:`check_shapes` compares the tensors with what ``config.json`` builds, so a
config that does not fit its weights is one line naming both, not an allocation or a
``load_state_dict`` traceback.
"""

from __future__ import annotations

import math
import stat
import struct
from pathlib import Path

from .errors import PrunusError
from .validate import parse_json, short

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FIX = "re-create the model dir"


def read_header(path: str | Path, fix: str = FIX) -> dict[str, dict]:
    """{name: {"dtype", "shape", "data_offsets"}} of a safetensors file, every entry checked (``fix``: what
    the one-line error tells the user to do)."""
    return read_layout(path, fix)[0]


def read_layout(path: str | Path, fix: str = FIX) -> tuple[dict[str, dict], dict[str, str], int]:
    """(the checked header as :func:`read_header` gives it, the ``__metadata__`` strings, the file offset of the
    first data byte: a tensor's bytes are ``data_offsets`` from there)."""
    path = Path(path)
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the open
            raise PrunusError(f"{path}: not a regular file (a directory, FIFO or device); {fix}")
        size = st.st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None or n > min(size - 8, MAX_HEADER_BYTES):
                raise PrunusError(f"{path}: truncated or not a safetensors file (header of {n} bytes in a "
                                  f"{size}-byte file); {fix}")
            raw = f.read(n)
    except OSError as e:
        raise PrunusError(f"{path}: cannot be read ({e.strerror}); {fix}") from None
    try:
        text = raw.decode("utf-8")  # what the format says (json.loads alone would take UTF-16 too)
    except UnicodeDecodeError as e:
        raise PrunusError(f"{path}: the safetensors header is not valid JSON (not UTF-8 at byte {e.start}); {fix}") from None
    header = parse_json(text, str(path), fix)
    if not isinstance(header, dict):
        raise PrunusError(f"{path}: the safetensors header is not a JSON object; {fix}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) and _utf8(k + v) for k, v in metadata.items()):
        raise PrunusError(f"{path}: the safetensors __metadata__ {short(metadata)} is not a mapping of strings; {fix}")
    data_bytes = size - 8 - n
    for name, entry in header.items():
        _check_entry(path, name, entry, data_bytes, fix)
    _check_tiling(path, header, data_bytes, fix)
    return header, metadata, 8 + n


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # "\ud800" in JSON parses to a lone surrogate, which no UTF-8 reader takes
        return False
    return True


def _check_tiling(path: Path, header: dict[str, dict], data_bytes: int, fix: str) -> None:
    """The tensors' bytes, in offset order, follow one another from the first data byte to the last (the
    format's rule, which the safetensors library enforces when it opens the file)."""
    end = 0
    for name, entry in sorted(header.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        start, stop = entry["data_offsets"]
        if start != end:
            raise PrunusError(f"{path}: tensor {short(name)} starts at data byte {start:,}, not {end:,} where the "
                              f"previous one ends (a gap or an overlap); {fix}")
        end = stop
    if end != data_bytes:
        raise PrunusError(f"{path}: the tensors hold {end:,} of the file's {data_bytes:,} data bytes "
                          f"(truncated, or bytes after them); {fix}")


def _check_entry(path: Path, name: str, entry, data_bytes: int, fix: str) -> None:
    where = f"{path}: tensor {short(name)}"
    if not _utf8(name):
        raise PrunusError(f"{where}: the name is not UTF-8 text (a lone surrogate escape); {fix}")
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str) or entry["dtype"] not in DTYPE_BYTES:
        raise PrunusError(f"{where} has no known dtype; {fix}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise PrunusError(f"{where}: shape {short(shape)} is not a list of sizes; {fix}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise PrunusError(f"{where}: data offsets {short(offsets)} lie outside the file's {data_bytes} data bytes "
                          f"(truncated?); {fix}")
    if math.prod(d for d in shape if d) >= 2**64:  # the library multiplies the sizes in 64 bits
        raise PrunusError(f"{where}: shape {short(shape)} holds more elements than a 64-bit count; {fix}")
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[entry["dtype"]]:
        raise PrunusError(f"{where}: {offsets[1] - offsets[0]} bytes do not hold a {entry['dtype']} tensor of shape "
                          f"{shape}; {fix}")


def check_shapes(path: str | Path, header: dict[str, dict], expected: dict[str, tuple[int, ...]]) -> None:
    """Every tensor the header holds that ``expected`` names has the expected shape."""
    for name, shape in expected.items():
        entry = header.get(name)
        if entry is not None and tuple(entry["shape"]) != tuple(shape):
            raise PrunusError(f"{path}: {name} has shape {tuple(entry['shape'])} but config.json builds "
                              f"{tuple(shape)}; the config does not fit the weights, {FIX}")
