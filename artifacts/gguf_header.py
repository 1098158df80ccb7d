"""The GGUF header, read and checked before any tensor is: the validator of llama.cpp's ``.gguf`` files.

A GGUF file is ``GGUF``, a version, a tensor count and a key/value count, the key/value metadata
(strings, numbers, arrays of them), one entry per tensor (name, dimensions, type, offset), and the
aligned tensor data. Every count and length in it is a number the file states, so
:func:`read_gguf_header` bounds each one by the bytes left in the file (and by a ceiling far above any
real model's) before reading what it counts: a header that claims twenty million array items, a
billion keys or a tensor past the end of the file is one :class:`PrunusError` line after reading a
few bytes, not an allocation. Strings must be UTF-8; tensors must have a known type, whole blocks of
it, an aligned offset, and bytes inside the file that no other tensor shares; the data section
holds the tensors and their alignment padding and nothing else, so a type or shape that does
not match the bytes a tensor was given is refused. Offsets are Python
integers, so a 64-bit offset that would wrap cannot come back inside the file.

Nothing here reads tensor data; :mod:`prunus.models.gguf_read` does, for the entries this returns.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import PrunusError
from .validate import short

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_KEYS = 65_536  # metadata keys: real files hold a few dozen
MAX_TENSORS = 65_536  # a dense model holds about 16 per layer
MAX_ITEMS = 1 << 21  # items in one metadata array: above any vocabulary (262k tokens) or merge list
MAX_NAME = 1 << 16  # bytes in a metadata key
MAX_TENSOR_NAME = 256  # bytes in a tensor name (llama.cpp's own limit is 64)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
FIX = "re-download or re-convert it"

# GGUF metadata value types: id -> (name, struct format); 8 is a string, 9 an array
SCALARS = {0: ("uint8", "B"), 1: ("int8", "b"), 2: ("uint16", "H"), 3: ("int16", "h"), 4: ("uint32", "I"),
           5: ("int32", "i"), 6: ("float32", "f"), 7: ("bool", "?"), 10: ("uint64", "Q"), 11: ("int64", "q"),
           12: ("float64", "d")}
STRING, ARRAY = 8, 9

# ggml tensor types: id -> (name, elements per block, bytes per block), as gguf.constants.GGML_QUANT_SIZES
QK = 256
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", QK, 4 + QK // 16 + QK // 4), 11: ("Q3_K", QK, 2 + QK // 4 + QK // 8 + 12),
    12: ("Q4_K", QK, 4 + QK // 2 + 12), 13: ("Q5_K", QK, 4 + QK // 2 + QK // 8 + 12),
    14: ("Q6_K", QK, 2 + QK // 2 + QK // 4 + QK // 16), 15: ("Q8_K", QK, 4 + QK + QK // 8),
    16: ("IQ2_XXS", QK, 2 + QK // 4), 17: ("IQ2_XS", QK, 2 + QK // 4 + QK // 32),
    18: ("IQ3_XXS", QK, 2 + QK // 4 + QK // 8), 19: ("IQ1_S", QK, 2 + QK // 8 + QK // 16), 20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", QK, 2 + QK // 4 + QK // 8 + QK // 32 + 4), 22: ("IQ2_S", QK, 2 + QK // 4 + QK // 16),
    23: ("IQ4_XS", QK, 4 + QK // 2 + QK // 64), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4),
    27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", QK, QK // 8 + QK // 16 + QK // 32), 30: ("BF16", 1, 2),
    34: ("TQ1_0", QK, 2 + 4 * 13), 35: ("TQ2_0", QK, 2 + 64), 39: ("MXFP4", 32, 17),
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor entry: ``shape`` in the file's order (columns first), ``offset`` from the file's start."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    block: int  # elements per block of the type
    offset: int
    n_bytes: int

    @property
    def rows_shape(self) -> tuple[int, ...]:
        """The shape in row-major (prunus / numpy) order: the file's dimensions reversed."""
        return tuple(reversed(self.shape))


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    size: int
    version: int
    metadata: dict  # key -> str | int | float | bool | list of those
    tensors: dict[str, GGUFTensor]  # in file order


class _Cursor:
    """A read position in the mapped file: every read checks the bytes it needs are there."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def fail(self, what: str) -> PrunusError:
        return PrunusError(f"{self.path}: {what}; {FIX}")

    def take(self, n: int, what: str) -> int:
        """Advance past ``n`` bytes; the position they start at."""
        if n > self.size - self.pos:
            raise self.fail(f"truncated or corrupt GGUF ({what} needs {n:,} bytes at byte {self.pos:,}, "
                            f"{self.size - self.pos:,} are left)")
        start, self.pos = self.pos, self.pos + n
        return start

    def unpack(self, fmt: str, what: str):
        return struct.unpack_from("<" + fmt, self.buf, self.take(struct.calcsize("<" + fmt), what))[0]

    def count(self, what: str, min_item_bytes: int, ceiling: int) -> int:
        """A uint64 count of items of at least ``min_item_bytes`` each, bounded by the bytes left and ``ceiling``."""
        n = self.unpack("Q", what)
        room = (self.size - self.pos) // max(min_item_bytes, 1)
        if n > min(room, ceiling):
            raise self.fail(f"truncated or corrupt GGUF ({what} is {n:,}, but "
                            + (f"the {self.size - self.pos:,} bytes left hold at most {room:,}" if n > room
                               else f"at most {ceiling:,} are read") + ")")
        return n

    def string(self, what: str, ceiling: int | None = None) -> str:
        n = self.count(f"the length of {what}", 1, ceiling if ceiling is not None else self.size)
        start = self.take(n, what)
        try:
            return str(self.buf[start:start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8 text (byte {e.start} of it)") from None


_U64 = struct.Struct("<Q")


def _strings(cur: _Cursor, n: int, what: str) -> list[str]:
    """``n`` strings in a row: :meth:`_Cursor.string` inlined, for vocabularies of a few hundred thousand."""
    buf, pos, size, unpack, out = cur.buf, cur.pos, cur.size, _U64.unpack_from, []
    for i in range(n):
        length = unpack(buf, pos)[0] if pos + 8 <= size else None
        if length is None or length > size - pos - 8:
            raise cur.fail(f"truncated or corrupt GGUF ({what} item {i} of {short(length)} bytes at byte {pos:,}, "
                           f"{size - pos:,} are left)")
        try:
            out.append(str(buf[pos + 8:pos + 8 + length], "utf-8"))
        except UnicodeDecodeError as e:
            raise cur.fail(f"{what} item {i} is not UTF-8 text (byte {e.start} of it)") from None
        pos += 8 + length
    cur.pos = pos
    return out


def _value(cur: _Cursor, kind: int, what: str):
    if kind in SCALARS:
        return cur.unpack(SCALARS[kind][1], what)
    if kind == STRING:
        return cur.string(what)
    if kind != ARRAY:
        raise cur.fail(f"{what} has value type {kind}, which GGUF does not define")
    item = cur.unpack("I", f"the item type of {what}")
    if item == STRING:
        return _strings(cur, cur.count(f"the item count of {what}", 8, MAX_ITEMS), what)
    if item not in SCALARS:
        raise cur.fail(f"{what} is an array of value type {item}, which prunus does not read "
                       "(arrays of arrays, or a type GGUF does not define)")
    fmt = SCALARS[item][1]
    size = struct.calcsize("<" + fmt)
    n = cur.count(f"the item count of {what}", size, MAX_ITEMS)
    return list(struct.unpack_from(f"<{n}{fmt}", cur.buf, cur.take(n * size, what)))


def _metadata(cur: _Cursor, n_keys: int) -> dict:
    meta = {}
    for i in range(n_keys):
        key = cur.string(f"metadata key {i}", MAX_NAME)
        what = f"metadata {short(key)}"
        if key in meta:
            raise cur.fail(f"{what} is given twice")
        meta[key] = _value(cur, cur.unpack("I", f"the value type of {what}"), what)
    return meta


def _tensor_entry(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string(f"the name of tensor {i}", MAX_TENSOR_NAME)
    what = f"tensor {short(name)}"
    n_dims = cur.unpack("I", f"the dimension count of {what}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"{what} has {n_dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}")
    shape = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.take(8 * n_dims, f"the dimensions of {what}"))
    kind = cur.unpack("I", f"the type of {what}")
    offset = cur.unpack("Q", f"the offset of {what}")
    return name, shape, kind, offset


def _check_tensor(cur: _Cursor, entry, data_start: int, alignment: int) -> GGUFTensor:
    name, shape, kind, offset = entry
    what = f"tensor {short(name)}"
    if kind not in GGML_TYPES:
        raise cur.fail(f"{what} has tensor type id {kind}, which GGUF does not define")
    type_name, block, block_bytes = GGML_TYPES[kind]
    if any(d < 1 for d in shape) or shape[0] % block:
        raise cur.fail(f"{what} has shape {list(shape)}, which is not whole {type_name} blocks of {block} "
                       "(every dimension at least 1)")
    n_bytes = math.prod(shape) // block * block_bytes  # Python integers: nothing wraps
    start = data_start + offset
    if offset % alignment:
        raise cur.fail(f"{what} starts at data offset {offset:,}, not a multiple of the alignment {alignment}")
    if start + n_bytes > cur.size:
        raise cur.fail(f"truncated or corrupt GGUF ({what} of {n_bytes:,} bytes at data offset {offset:,} ends "
                       f"past the end of the {cur.size:,}-byte file)")
    return GGUFTensor(name, tuple(int(d) for d in shape), type_name, block, start, n_bytes)


def _check_layout(cur: _Cursor, tensors: list[GGUFTensor], data_start: int, alignment: int) -> None:
    """Every byte of the data section belongs to one tensor or to the padding after one: overlapping tensors,
    and a type or shape that accounts for fewer bytes than the tensor was given, are refused."""
    ordered = sorted(tensors, key=lambda t: t.offset)
    if not ordered:
        return
    ends = [("the start of the data", data_start)] + [(f"tensor {short(t.name)}", t.offset + t.n_bytes) for t in ordered]
    starts = [(f"tensor {short(t.name)}", t.offset) for t in ordered] + [("the end of the file", cur.size)]
    for (before, end), (after, start) in zip(ends, starts):
        if end > start:
            raise cur.fail(f"{before} and {after} share bytes (overlapping tensor data)")
        if start - end >= alignment:
            raise cur.fail(f"{start - end:,} bytes between {before} and {after} belong to no tensor (a tensor type "
                           "or shape that does not match its data)")


def _alignment(cur: _Cursor, meta: dict) -> int:
    alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if (not isinstance(alignment, int) or isinstance(alignment, bool) or not 1 <= alignment <= 1 << 20
            or alignment & (alignment - 1)):
        raise cur.fail(f"metadata general.alignment={short(alignment)} is not a power of two up to 1,048,576")
    return alignment


def _parse(buf, path: Path) -> GGUFHeader:
    cur = _Cursor(buf, path)
    cur.take(4, "the magic")
    version = cur.unpack("I", "the version")
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        raise cur.fail("a big-endian GGUF, which prunus does not read" if swapped in VERSIONS else
                       f"GGUF version {version}, which prunus does not read (it reads versions 2 and 3)")
    n_tensors = cur.count("the tensor count", 24, MAX_TENSORS)  # name length, dims count, a dim, type, offset
    n_keys = cur.count("the metadata key count", 13, MAX_KEYS)  # key length, value type, a 1-byte value
    meta = _metadata(cur, n_keys)
    entries = [_tensor_entry(cur, i) for i in range(n_tensors)]
    alignment = _alignment(cur, meta)
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for entry in entries:
        t = _check_tensor(cur, entry, data_start, alignment)
        if t.name in tensors:
            raise cur.fail(f"tensor {short(t.name)} is given twice")
        tensors[t.name] = t
    _check_layout(cur, list(tensors.values()), data_start, alignment)
    return GGUFHeader(path, cur.size, version, meta, tensors)


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The metadata and tensor entries of the GGUF file ``path``, every count, length, offset and string
    checked; one PrunusError line naming the file for anything else."""
    path = Path(path)
    try:
        if not path.is_file():
            raise PrunusError(f"{path}: no such file; give a .gguf file")
        with open(path, "rb") as f:
            if f.read(4) != MAGIC:
                raise PrunusError(f"{path}: not a GGUF file (it does not start with 'GGUF'); "
                                  "give a .gguf file written by llama.cpp")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, path)
    except OSError as e:
        raise PrunusError(f"{path}: cannot be read ({e.strerror or e}); give a readable .gguf file") from None
