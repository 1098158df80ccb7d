"""The files a table spec (:mod:`.tables`) names, read bounded: CSV (the standard library's reader), Parquet
(pyarrow), NPY and NPZ (numpy, ``allow_pickle=False``).

Every size is checked before anything is allocated: the file's bytes (CSV, Parquet, NPZ members) and an array's
shape and dtype from its header (NPY, NPZ) against ``PRUNUS_MAX_TABLE_MB`` (default 1024 MiB). A CSV or Parquet
file is read as named columns of cells (:class:`Columns`), an NPY / NPZ file as named numeric arrays.
"""

from __future__ import annotations

import csv
import io
import math
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prunus.artifacts.errors import PrunusError

NUMERIC_KINDS = "biuf"  # bool, signed, unsigned, float: nothing that holds objects


def table_limit() -> int:
    """The most bytes a table file (or its arrays) may take: ``PRUNUS_MAX_TABLE_MB`` MiB, default 1024."""
    text = os.environ.get("PRUNUS_MAX_TABLE_MB", "1024")
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not 0 < mb <= 1 << 24:
        raise PrunusError(f"PRUNUS_MAX_TABLE_MB={text!r} must be a number of MiB above 0")
    return int(mb * (1 << 20))


@dataclass
class Columns:
    """A table's named columns of cells (strings from a CSV, Python values from Parquet), ``first_row`` the number
    a reader gives its first data row (a CSV's line 2, a Parquet's row 0)."""

    names: list[str]
    cells: dict[str, list]
    rows: int
    row_word: str  # "line" (CSV) or "row" (Parquet)
    first_row: int


def check_size(path: Path, nbytes: int, what: str, source: str) -> None:
    limit = table_limit()
    if nbytes > limit:
        raise PrunusError(f"{source}: {what} takes {nbytes:,} bytes, above PRUNUS_MAX_TABLE_MB ({limit:,} bytes); "
                          "raise the variable or split the table")


def read_csv(path: Path, source: str) -> Columns:
    """The CSV file's columns (the first line names them); a row of another width is one line naming it."""
    check_size(path, path.stat().st_size, "the file", source)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise PrunusError(f"{source}: not UTF-8 text (byte {e.start:,}); save the CSV as UTF-8") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    if not header or not any(h.strip() for h in header):
        raise PrunusError(f"{source}: the table is empty; give a CSV whose first line names its columns")
    names = [h.strip() for h in header]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes or "" in names:
        raise PrunusError(f"{source}: column {'name ' + repr(dupes[0]) + ' repeats' if dupes else 'without a name'} "
                          "in the first line; name every column once")
    cells: dict[str, list] = {n: [] for n in names}
    rows = 0
    for row in reader:
        if not row or (len(row) == 1 and not row[0].strip()):
            continue  # a blank line
        if len(row) != len(names):
            raise PrunusError(f"{source}: line {reader.line_num} has {len(row)} cells for {len(names)} columns; "
                              "give every row one cell a column")
        for name, cell in zip(names, row):
            cells[name].append(cell.strip())
        rows += 1
    return Columns(names, cells, rows, "line", 2)


def read_parquet(path: Path, source: str) -> Columns:
    """The Parquet file's columns, its uncompressed size (from the footer) bounded before any is read."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrunusError(f"{source}: reading Parquet needs pyarrow; pip install 'prunus[parquet]'") from None
    check_size(path, path.stat().st_size, "the file", source)
    try:
        pf = pq.ParquetFile(path)
        meta = pf.metadata
        check_size(path, sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)),
                   "the uncompressed table", source)
        table = pf.read()
    except PrunusError:
        raise
    except Exception as e:  # pyarrow's ArrowInvalid / OSError for a file that is not Parquet
        raise PrunusError(f"{source}: not a readable Parquet file ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:120]}); re-write it") from None
    names = [str(n) for n in table.column_names]
    return Columns(names, {n: table.column(i).to_pylist() for i, n in enumerate(names)}, table.num_rows, "row", 0)


def _npy_header(f, what: str, source: str) -> tuple[tuple[int, ...], np.dtype]:
    from numpy.lib import format as npf

    try:
        version = npf.read_magic(f)
        shape, _, dtype = (npf.read_array_header_1_0(f) if version == (1, 0) else npf.read_array_header_2_0(f))
    except ValueError as e:
        raise PrunusError(f"{source}: {what} is not an NPY array ({str(e)[:120]}); save it with numpy.save") from None
    if dtype.kind not in NUMERIC_KINDS or dtype.fields is not None:
        raise PrunusError(f"{source}: {what} holds {dtype} values; give numbers (integers or floats)")
    return tuple(shape), dtype


def read_npy(path: Path, source: str) -> dict[str, np.ndarray]:
    """``{"0": the array}`` of an NPY file, its header checked first (numbers only, the size bounded)."""
    check_size(path, path.stat().st_size, "the file", source)
    with open(path, "rb") as f:
        shape, dtype = _npy_header(f, "the file", source)
    check_size(path, math.prod(shape) * dtype.itemsize, f"an array of {shape}", source)
    return {"0": np.load(path, allow_pickle=False)}


def read_npz(path: Path, source: str) -> dict[str, np.ndarray]:
    """The named arrays of an NPZ file, each member's header checked before it is read."""
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise PrunusError(f"{source}: not an NPZ archive ({e}); save it with numpy.savez") from None
    total, arrays = 0, {}
    with zf:
        for info in zf.infolist():
            name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
            with zf.open(info) as f:
                shape, dtype = _npy_header(f, f"array {name!r}", source)
            total += math.prod(shape) * dtype.itemsize
            check_size(path, total, "its arrays", source)
            with zf.open(info) as f:
                arrays[name] = np.lib.format.read_array(f, allow_pickle=False)
    if not arrays:
        raise PrunusError(f"{source}: the archive holds no arrays; save them with numpy.savez(path, x=..., y=...)")
    return arrays
