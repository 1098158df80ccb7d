"""The grid a ``--tp-mode`` arranges ``--tp`` ranks in, checked before any process starts (no torch here).

* ``1d``: Megatron tensor + sequence parallelism over one dim (``tensor_parallel.py``);
* ``2d``: SUMMA / Optimus, a ``q x q`` grid (``--tp`` a square);
* ``2.5d``: Tesseract, ``d`` layers of a ``q x q`` grid (``--tp = q*q*d``, ``d = --tp-depth``);
* ``3d``: a ``q x q x q`` cube (``--tp`` a cube).
"""

from __future__ import annotations

from prunus.artifacts.errors import PrunusError

TP_MODES = ("1d", "2d", "2.5d", "3d")
# the mesh dims each mode splits the tp dim into, outermost first
GRID_DIMS = {"2d": ("tp_row", "tp_col"), "2.5d": ("tp_dep", "tp_row", "tp_col"), "3d": ("tp_x", "tp_y", "tp_z")}


def _root(n: int, k: int) -> int | None:
    r = round(n ** (1 / k))
    for c in (r - 1, r, r + 1):
        if c >= 1 and c ** k == n:
            return c
    return None


def grid_shape(mode: str, tp: int, depth: int = 1) -> dict[str, int]:
    """``{mesh dim name: size}`` of ``mode``'s grid over ``tp`` ranks; PrunusError (one line) when ``tp`` does not fit."""
    if mode not in TP_MODES:
        raise PrunusError(f"--tp-mode {mode}: choose one of {', '.join(TP_MODES)}")
    if depth < 1:
        raise PrunusError(f"--tp-depth {depth} must be at least 1")
    if mode != "2.5d" and depth != 1:
        raise PrunusError(f"--tp-depth {depth} applies to --tp-mode 2.5d only; leave it at 1 with --tp-mode {mode}")
    if mode == "1d":
        return {"tp": tp}
    if tp < 2:
        raise PrunusError(f"--tp-mode {mode} needs --tp above 1 (2d: 4, 9, ...; 2.5d: q*q*depth; 3d: 8, 27, ...)")
    if mode == "2d":
        q = _root(tp, 2)
        if q is None:
            raise PrunusError(f"--tp {tp} --tp-mode 2d: the degree must be a square (4, 9, 16, ...) to form a q x q grid")
        return dict(zip(GRID_DIMS["2d"], (q, q)))
    if mode == "2.5d":
        q = _root(tp // depth, 2) if tp % depth == 0 else None
        if q is None or q < 2:
            raise PrunusError(f"--tp {tp} --tp-mode 2.5d --tp-depth {depth}: the depth must divide the degree and leave "
                              "a square of at least 4 (tp = q*q*depth, e.g. --tp 8 --tp-depth 2)")
        return dict(zip(GRID_DIMS["2.5d"], (depth, q, q)))
    q = _root(tp, 3)
    if q is None:
        raise PrunusError(f"--tp {tp} --tp-mode 3d: the degree must be a cube (8, 27, 64, ...) to form a q x q x q grid")
    return dict(zip(GRID_DIMS["3d"], (q, q, q)))


def grid_side(mode: str, tp: int, depth: int = 1) -> int:
    """``q``, the side of the grid (``tp`` for 1d)."""
    return list(grid_shape(mode, tp, depth).values())[-1]


def row_split(mode: str, tp: int, depth: int = 1) -> int:
    """How many parts each batch is split into by sequences (every rank holds whole sequences of its part)."""
    q = grid_side(mode, tp, depth)
    return {"1d": 1, "2d": q, "2.5d": q * depth, "3d": q * q}[mode]
