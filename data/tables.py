"""Tables and arrays as a generic module's ``--data``: ``PATH?target=NAME&features=A,B,C``.

| file | features (default) | target (default) | sample input |
|---|---|---|---|
| ``.csv`` (first line names the columns), ``.parquet`` | columns (all but the target) | a column (the last) | float32 ``(F,)`` |
| ``.npy``, a 2-D array ``(N, F)`` | column indices (all but the target) | a column index (the last) | float32 ``(F,)`` |
| ``.npz`` | one array ``(N, ...)`` (``x``) | one array ``(N, ...)`` (``y``) | the array's row |

An NPZ input of integers stays int64 (token sequences ``(N, T)``); floats become float32 (``(N, T)`` or
``(N, T, C)`` sequences, or any shape). A classification target (integers or text) is mapped to class indices
in sorted order (integers before text); the class names go into the model dir (``labels.json``,
:func:`model_dir_files`) so ``prunus eval`` maps labels the same way. A regression target becomes float32
``(k,)`` for ``k`` target columns (or the NPZ array's row).

A missing, non-numeric or non-finite cell, a column that does not exist or an empty table is one line naming
the row and column. The held-out split is ``val_fraction`` of the rows by a seeded permutation (0: none, 1: all,
for a separate test set).
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import parse_qsl

import numpy as np
import torch
from torch.utils.data import Dataset

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short
from prunus.models.class_labels import LABELS, LABELS_FORMAT, read_labels  # noqa: F401 (read_labels: this module's API too)

from .table_read import Columns, read_csv, read_npy, read_npz, read_parquet

SUFFIXES = {".csv": read_csv, ".parquet": read_parquet, ".pq": read_parquet, ".npy": read_npy, ".npz": read_npz}
KEYS = ("target", "features")
MAX_CLASSES = 100_000


class TableDataset(Dataset):
    """Rows of a table as (input, target) tensors; ``classes`` the class names of a classification target."""

    finite_checked = True  # every cell was checked as the table was read
    exact_classes = True  # a classifier must score exactly the classes (module_fit)

    def __init__(self, x: torch.Tensor, y: torch.Tensor, classes: list | None, meta: dict):
        self.x, self.y, self.classes, self.meta = x, y, classes, meta

    @property
    def num_classes(self) -> int | None:
        return len(self.classes) if self.classes is not None else None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]

    def subset(self, rows: torch.Tensor) -> "TableDataset":
        return TableDataset(self.x[rows], self.y[rows], self.classes, self.meta)


def is_table_spec(spec: str) -> bool:
    """Whether ``spec`` names a table file (by its suffix, before any ``?``)."""
    return Path(spec.split("?", 1)[0]).suffix.lower() in SUFFIXES


def parse_table_spec(spec: str) -> tuple[Path, dict]:
    """(the file, its ``target`` / ``features`` fields); one line for an unknown field or a missing file."""
    path_text, _, query = spec.partition("?")
    params = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(params) - set(KEYS))
    if unknown:
        raise PrunusError(f"--data {short(spec)}: unknown field {unknown[0]!r}; a table takes "
                          "PATH?target=COLUMN&features=A,B,C")
    path = Path(path_text)
    if not path.is_file():
        what = "does not exist" if not path.exists() else "is not a file"
        raise PrunusError(f"--data {short(spec)}: {path} {what}; give a .csv, .parquet, .npy or .npz file")
    return path, params


def _where(cols: Columns, i: int, name: str) -> str:
    return f"{cols.row_word} {cols.first_row + i}, column {name!r}"


def float_column(cols: Columns, name: str, source: str) -> np.ndarray:
    """Column ``name`` as float64; a missing, non-numeric or non-finite cell is one line naming it."""
    cells = cols.cells[name]
    for i, cell in enumerate(cells):
        if cell is None or cell == "":
            raise PrunusError(f"{source}: {_where(cols, i, name)} is empty; fill it or drop the row")
    try:
        values = np.asarray(cells, dtype=np.float64)
    except (ValueError, TypeError):
        for i, cell in enumerate(cells):
            try:
                float(cell)
            except (ValueError, TypeError):
                raise PrunusError(f"{source}: {_where(cols, i, name)} holds {short(cell)}, not a number; give "
                                  "numbers (leave a text column out of features=; a text target is --task "
                                  "classification)") from None
        raise
    bad = np.flatnonzero(~np.isfinite(values))
    if len(bad):
        i = int(bad[0])
        raise PrunusError(f"{source}: {_where(cols, i, name)} holds {cells[i]!r}, not a finite number; fix or drop "
                          "the row")
    return values


def label(value, where: str, source: str):
    """A class label as an int or a string: integers (and integral floats) as ints, other text as it is."""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        if not np.isfinite(value) or not float(value).is_integer():
            raise PrunusError(f"{source}: {where} holds {value!r}, not a class; give integer or text labels "
                              "(a float target is --task regression)")
        return int(value)
    if value is None or value == "":
        raise PrunusError(f"{source}: {where} is empty; give every row a class")
    text = str(value).strip()
    return int(text) if text.lstrip("-").isdigit() else text


def class_indices(labels: list, where, classes: list | None, source: str) -> tuple[torch.Tensor, list]:
    """(class indices, the classes): ``classes`` given (a model's) or the labels' own, sorted (ints first)."""
    if classes is None:
        classes = sorted(set(labels), key=lambda v: (isinstance(v, str), v))
        if len(classes) > MAX_CLASSES:
            raise PrunusError(f"{source}: {len(classes):,} distinct classes in the target, above {MAX_CLASSES:,}; "
                              "a float target is --task regression")
    index = {str(c): i for i, c in enumerate(classes)}
    out = np.empty(len(labels), dtype=np.int64)
    for i, v in enumerate(labels):
        k = index.get(str(v))
        if k is None:
            raise PrunusError(f"{source}: {where(i)} holds class {short(v)}, not among the {len(classes)} classes the "
                              f"model was trained on ({short(classes)}); give data of those classes")
        out[i] = k
    return torch.from_numpy(out), classes


def model_dir_files(dataset) -> dict[str, bytes] | None:
    """The files a model dir trained on ``dataset`` keeps beside its weights: a table's ``labels.json`` (its
    features, target and classes), else none."""
    if not isinstance(dataset, TableDataset):
        return None
    return {LABELS: json.dumps({"format": LABELS_FORMAT, **dataset.meta, "classes": dataset.classes}).encode()}


def split_rows(dataset: TableDataset, val_fraction: float, seed: int = 0):
    """(train, held-out) by a seeded permutation of the rows: ``val_fraction`` of them held out (at least one when
    it is above 0 and two rows or more exist; 1.0: every row, with no training rows, for a test set)."""
    n = len(dataset)
    if val_fraction >= 1:
        return None, dataset
    k = 0 if val_fraction <= 0 else min(n - 1, max(1, round(n * val_fraction)))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return dataset.subset(order[k:]), dataset.subset(order[:k]) if k else None


def _names(text: str | None, have: list[str], default: list[str], what: str, source: str) -> list[str]:
    """The column names a field lists (comma-separated), each checked to exist; ``default`` when absent."""
    if text is None:
        return default
    names = [n.strip() for n in text.split(",") if n.strip()]
    missing = [n for n in names if n not in have]
    if not names or missing:
        raise PrunusError(f"{source}: {what} column {short(missing[0]) if missing else '(none)'} does not exist; the "
                          f"columns are {short(', '.join(have))}")
    return names


def _target(cols: Columns, targets: list[str], task: str, classes: list | None, source: str):
    if task != "classification":
        y = np.stack([float_column(cols, t, source) for t in targets], axis=1)
        return torch.from_numpy(y.astype(np.float32)), None
    if len(targets) != 1:
        raise PrunusError(f"{source}: classification takes one target column, not {len(targets)}")
    name = targets[0]
    labels = [label(v, _where(cols, i, name), source) for i, v in enumerate(cols.cells[name])]
    return class_indices(labels, lambda i: _where(cols, i, name), classes, source)


def _from_columns(cols: Columns, params: dict, task: str, classes: list | None, source: str) -> TableDataset:
    """A CSV's or Parquet file's rows: the feature columns as float32, the target as classes or numbers."""
    if cols.rows == 0:
        raise PrunusError(f"{source}: the table is empty (no rows under its header); give rows of data")
    default_target = cols.names[-1:] if "target" not in params else []
    targets = _names(params.get("target"), cols.names, default_target, "target", source)
    features = _names(params.get("features"), cols.names, [n for n in cols.names if n not in targets], "feature",
                      source)
    if not features:
        raise PrunusError(f"{source}: no feature columns beside the target; name them with features=A,B,C")
    x = np.stack([float_column(cols, f, source) for f in features], axis=1).astype(np.float32)
    y, classes = _target(cols, targets, task, classes, source)
    return TableDataset(torch.from_numpy(x), y, classes, {"features": features, "target": targets})


def _array_rows(a: np.ndarray, name: str, source: str) -> torch.Tensor:
    """An NPZ array as a tensor: integers int64, floats float32 (a non-finite value named by its row)."""
    if a.dtype.kind == "f":
        bad = np.argwhere(~np.isfinite(a))
        if len(bad):
            raise PrunusError(f"{source}: array {name!r} row {int(bad[0][0])} holds {a[tuple(bad[0])]!r}; fix or "
                              "drop the row")
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


def _npy_columns(array: np.ndarray, source: str) -> Columns:
    """A 2-D NPY array as columns named by index ("0", "1", ...)."""
    if array.ndim != 2:
        raise PrunusError(f"{source}: an NPY table is a 2-D array (rows, columns), not {array.shape}; give sequences "
                          "as an .npz of x (N, T) or (N, T, C) and y")
    names = [str(i) for i in range(array.shape[1])]
    return Columns(names, {n: array[:, i].tolist() for i, n in enumerate(names)}, array.shape[0], "row", 0)


def _from_arrays(arrays: dict, params: dict, task: str, classes: list | None, source: str) -> TableDataset:
    """An NPZ file's input array (``features=``, default ``x``) and target array (``target=``, default ``y``)."""
    xn, yn = params.get("features", "x"), params.get("target", "y")
    for name in (xn, yn):
        if name not in arrays:
            raise PrunusError(f"{source}: array {name!r} does not exist; the archive holds {short(', '.join(arrays))}")
    xa, ya = arrays[xn], arrays[yn]
    if xa.ndim < 2 or xa.shape[0] == 0 or ya.shape[:1] != xa.shape[:1]:
        raise PrunusError(f"{source}: arrays {xn!r} {xa.shape} and {yn!r} {ya.shape} must hold the same number of "
                          "rows, at least one, the input at least 2-D (N, F), (N, T) or (N, T, C)")
    x = _array_rows(xa, xn, source)
    if task != "classification":
        y = _array_rows(ya.astype(np.float64), yn, source)
        y = y.reshape(-1, 1) if y.ndim == 1 else y
    else:
        if ya.ndim != 1:
            raise PrunusError(f"{source}: a classification target is one class a row; {yn!r} is {ya.shape}")
        labels = [label(v, f"array {yn!r} row {i}", source) for i, v in enumerate(ya.tolist())]
        y, classes = class_indices(labels, lambda i: f"array {yn!r} row {i}", classes, source)
    return TableDataset(x, y, classes, {"features": [xn], "target": [yn]})


def table_dataset(spec: str, task: str | None = None, classes: list | None = None) -> TableDataset:
    """Every row of the table ``spec`` names; ``classes``: a model's (its labels mapped to them), else the
    target's own. ``task`` None: classification for integer or text targets, regression for floats."""
    path, params = parse_table_spec(spec)
    source = f"--data {short(spec)}"
    suffix = path.suffix.lower()
    data = SUFFIXES[suffix](path, source)
    if suffix == ".npz":
        return _from_arrays(data, params, task or _guess_task(data.get(params.get("target", "y"))), classes, source)
    cols = _npy_columns(data["0"], source) if suffix == ".npy" else data
    if suffix == ".npy" and "target" not in params:
        params = {**params, "target": cols.names[-1]}
    return _from_columns(cols, params, task or _guess_column_task(cols, params), classes, source)


def _guess_task(y) -> str:
    return "regression" if y is not None and y.dtype.kind == "f" else "classification"


def _guess_column_task(cols: Columns, params: dict) -> str:
    name = params.get("target", cols.names[-1] if cols.names else "")
    values = cols.cells.get(name, [])[:1000]
    try:
        return "classification" if all(float(v).is_integer() for v in values) or not values else "regression"
    except (TypeError, ValueError):
        return "classification"


def table_datasets(spec: str, val_fraction: float = 0.1, *, task: str | None = None, classes: list | None = None):
    """(train, held-out) of the table ``spec`` names (see the module docstring)."""
    return split_rows(table_dataset(spec, task, classes), val_fraction)
