"""Synthetic datasets for generic modules: ``synthetic:classification?n=256&shape=3x32x32&classes=10``.

Sample ``i`` is drawn from its own generator (seeded by the seed and ``i``), so a dataset needs no memory
beyond one sample and every process sees the same samples. The targets are learnable: a class is the argmax of
a fixed random linear map of the input, a regression target that map itself (scaled) plus a little noise.
The held-out split is the next ``val`` samples of the same stream.

| kind | parameters (default) | sample |
|---|---|---|
| classification | n (256), shape (3x32x32), classes (10), val (n / 4), seed (0) | (float32 input of ``shape``, int64 class) |
| regression | n (256), shape (16), outputs (1), val (n / 4), seed (0) | (float32 input of ``shape``, float32 target of (outputs,)) |
"""

from __future__ import annotations

import math
from urllib.parse import parse_qsl

import torch
from torch.utils.data import Dataset

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short

PREFIX = "synthetic:"
KINDS = ("classification", "regression")
MAX_SAMPLES, MAX_SAMPLE_SIZE, MAX_CLASSES = 10_000_000, 2**24, 100_000
_DEFAULTS = {"classification": {"n": "256", "shape": "3x32x32", "classes": "10", "seed": "0"},
             "regression": {"n": "256", "shape": "16", "outputs": "1", "seed": "0"}}


class SyntheticDataset(Dataset):
    """Samples ``offset .. offset + n - 1`` of one synthetic stream (see the module docstring)."""

    finite_checked = True  # normal draws and their linear map: always finite

    def __init__(self, kind: str, n: int, shape: tuple[int, ...], width: int, seed: int = 0, offset: int = 0):
        self.kind, self.n, self.shape, self.width, self.seed, self.offset = kind, n, tuple(shape), width, seed, offset
        gen = torch.Generator().manual_seed(seed * 2 + 1)
        self.map = torch.randn(math.prod(self.shape), width, generator=gen) / math.sqrt(math.prod(self.shape))
        self.classes = width if kind == "classification" else None
        self.num_classes = self.classes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        gen = torch.Generator().manual_seed((self.seed << 32) + self.offset + i)
        x = torch.randn(self.shape, generator=gen)
        z = x.flatten() @ self.map
        if self.kind == "classification":
            return x, z.argmax()
        return x, z + 0.01 * torch.randn(self.width, generator=gen)

    def split(self, n: int) -> "SyntheticDataset":
        """The ``n`` samples that follow this dataset's in the same stream (a held-out split)."""
        return SyntheticDataset(self.kind, n, self.shape, self.width, self.seed, self.offset + self.n)


def _int(params: dict, key: str, lo: int, hi: int, spec: str) -> int:
    text = params[key]
    if not text.isdigit() or not lo <= int(text) <= hi:
        raise PrunusError(f"--data {short(spec)}: {key}={short(text)} must be an integer from {lo} to {hi:,}")
    return int(text)


def _shape(text: str, spec: str) -> tuple[int, ...]:
    parts = text.lower().split("x")
    if not 1 <= len(parts) <= 8 or not all(p.isdigit() and 1 <= int(p) <= MAX_SAMPLE_SIZE for p in parts):
        raise PrunusError(f"--data {short(spec)}: shape={short(text)} must be sizes joined by x, e.g. 3x32x32")
    shape = tuple(int(p) for p in parts)
    if math.prod(shape) > MAX_SAMPLE_SIZE:
        raise PrunusError(f"--data {short(spec)}: shape {text} holds more than {MAX_SAMPLE_SIZE:,} values a sample")
    return shape


def synthetic_datasets(spec: str) -> tuple[SyntheticDataset, SyntheticDataset]:
    """(train, held-out) of ``synthetic:KIND?key=value&...``; one line for anything else."""
    kind, _, query = spec[len(PREFIX):].partition("?")
    if kind not in KINDS:
        raise PrunusError(f"--data {short(spec)}: synthetic kind {short(kind)}; choose {' or '.join(KINDS)}, "
                          "e.g. synthetic:classification?n=256&shape=3x32x32&classes=10")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=16)
    except ValueError:
        raise PrunusError(f"--data {short(spec)}: the parameters must be key=value joined by &") from None
    params = {**_DEFAULTS[kind]}
    known = {*params, "val"}
    for key, value in pairs:
        if key not in known:
            raise PrunusError(f"--data {short(spec)}: unknown parameter {short(key)}; known: {', '.join(sorted(known))}")
        params[key] = value
    n = _int(params, "n", 1, MAX_SAMPLES, spec)
    width_key = "classes" if kind == "classification" else "outputs"
    width = _int(params, width_key, 2 if kind == "classification" else 1, MAX_CLASSES, spec)
    val = _int(params, "val", 1, MAX_SAMPLES, spec) if "val" in params else max(1, n // 4)
    train = SyntheticDataset(kind, n, _shape(params["shape"], spec), width, _int(params, "seed", 0, 2**31 - 1, spec))
    return train, train.split(val)
