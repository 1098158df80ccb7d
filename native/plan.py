"""How a linear pass groups its rows, per matrix shape and row count, measured on this machine and cached.

``decode.c``'s ``gemm_task`` goes over each weight tile with the wide kernels (fp32 three rows, int8 / int4 four
rows at a time), pairs of rows and single rows; a pass's *grouping* says which of them it uses and whether its pairs
prefetch the next tile (``PLAN_*`` bits). Without a plan the fixed rules run (:func:`fixed_rule`, measured once on
one CPU). On the batch-invariant paths (``avx2``, ``avxvnni``) every kernel sums a row in the same order, so any
grouping gives the same bits and the choice is only one of speed: at load, :func:`calibrate` times each candidate
grouping on the model's own packed weights, for each distinct (kind, k, n) and each row count bucket (1, 2, 3, 4, 5,
6-7, 8-15, 16+), with the decoder's thread count, and keeps the fastest (the fixed rule unless another is faster by
more than :data:`MARGIN`). Each timed call takes the next of the shape's layers (a large matrix, the head: the next
slice of its tiles), so the weights come from memory as in a pass, not from a cache that one layer fills.

The result is cached as one JSON file under ``$XDG_CACHE_HOME/prunus/native/plans``
(:mod:`prunus.artifacts.cache_dir`: ``0o700`` dirs, never followed through a symlink, written under a lock into a
temporary file renamed into place), named by a hash of its key: the CPU model, the kernel library's SHA-256, the
kernel path, the thread count and the shapes. A cached file is used only when its key matches this load's exactly
and every entry is a valid grouping; anything else (damaged, from another CPU or library) is measured again and
named in one line in the engine's info (``native_plan``). ``PRUNUS_NATIVE_PLAN=off`` keeps the fixed rules;
``=calibrate`` measures again whatever is cached.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prunus.artifacts.errors import PrunusError

from .build import cpu_model
from .weights import KINDS, PackedLinear, PackedModel, shape_key

WIDE, PAIRS, PREFETCH, THREE = 1, 2, 4, 8  # decode.c's PLAN_* bits
N_CODES = 16  # groupings: every combination of the bits
PLAN_ROWS = 17  # entries per plan: row counts 0..16, the last for 16 rows or more (decode.c's PLAN_ROWS)
BUCKETS = {2: (2,), 3: (3,), 4: (4,), 5: (5,), 6: (6, 7), 8: tuple(range(8, 16)), 16: (16,)}  # measured at: covers
MARGIN = 0.05  # another grouping replaces the fixed rule only when faster by more than this
REPS = 3  # timed samples per candidate (the fastest counts)
SAMPLE_VIEWS = 3  # a sample: calls over this many of the shape's layers (or slices) in turn, their mean
BUDGET_S = 1.5  # the calibration stops here; what it has not measured keeps the fixed rules
SLICE_BYTES = 4 << 20  # a larger matrix is timed a slice of its tiles at a time
MIN_BYTES = 128 << 10  # smaller matrices keep the fixed rules: a pass over them is shorter than the pool's wake-up
PLAN_ENV = "PRUNUS_NATIVE_PLAN"
MODES = ("auto", "off", "calibrate")
PLAN_FORMAT = "prunus-native-plan/1"
MAX_PLAN_BYTES = 1 << 20
FIX = f"or set XDG_CACHE_HOME to a dir of your own, or {PLAN_ENV}=off"


def fixed_rule(kind: str, m: int) -> int:
    """The grouping decode.c's fixed rules give a pass of ``m`` rows (its ``grouping()`` without a plan)."""
    wide = m >= 16 if kind == "f32" else (m >= 16 or 4 <= m < 6)
    return (WIDE if wide else 0) | PAIRS | (PREFETCH if m >= 6 else 0)


def candidates(kind: str, m: int) -> list[int]:
    """The groupings timed for ``m`` rows: pairs with and without prefetch, single rows up to three rows, the wide
    kernels first where ``m`` fills them, and int8 / int4 three rows at a time (with the wide ones first from seven
    rows); 16 rows or more (prompts, whose row blocks the wide kernels serve): the wide ones only."""
    wide = [WIDE | PAIRS, WIDE | PAIRS | PREFETCH] if m >= (3 if kind == "f32" else 4) else []
    if m >= 16:
        return wide
    three = [] if kind == "f32" or m < 3 else [THREE | PAIRS, THREE | PAIRS | PREFETCH]
    three += [WIDE | THREE | PAIRS | PREFETCH] if three and m >= 7 else []
    return [*([0] if m <= 3 else []), PAIRS, PAIRS | PREFETCH, *wide, *three]


def model_linears(packed: PackedModel) -> list[PackedLinear]:
    """Every linear layer the decoder runs, the head last."""
    out = [lin for layer in packed.layers for lin in layer.values() if isinstance(lin, PackedLinear)]
    return out + ([packed.head] if packed.head is not None else [])


def by_shape(packed: PackedModel) -> dict[str, list[PackedLinear]]:
    shapes: dict[str, list[PackedLinear]] = {}
    for lin in model_linears(packed):
        shapes.setdefault(shape_key(lin), []).append(lin)
    return shapes


@dataclass
class Plan:
    """Groupings by shape key (lists of :data:`PLAN_ROWS` codes); ``how``: calibrated / cached / default, with why."""

    plans: dict[str, list[int]] = field(default_factory=dict)
    how: str = "default"

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(v, np.uint8) for k, v in self.plans.items()}


# --- timing ----------------------------------------------------------------------------------------------------------

def _views(lins: list[PackedLinear]) -> list:
    """LinearC views to time a shape on: each layer whole, or a large one (the head) a slice of tiles at a time."""
    from .decoder import LinearC, _address

    views = []
    for lin in lins:
        step = max(1, int(lin.tiles * SLICE_BYTES // max(lin.w.nbytes, 1)))
        for t0 in range(0, lin.tiles, step):
            t1 = min(lin.tiles, t0 + step)
            sl = (lambda a: None if a is None else a[t0:t1])
            bias = None if lin.bias is None else lin.bias[4 * t0:4 * t1]
            n = min(lin.n, 4 * t1) - 4 * t0
            views.append(LinearC(KINDS[lin.kind], n, lin.k, t1 - t0, _address(sl(lin.w)), _address(sl(lin.s)),
                                 _address(sl(lin.sz)), _address(bias)))
    return views


class _Timer:
    """Times ``prunus_linear`` over a shape's views in turn, with every entry of the plan set to one grouping."""

    def __init__(self, lib, pool, lins: list[PackedLinear]):
        self.lib, self.pool, self.views, self.i = lib, pool, _views(lins), 0
        k, n = lins[0].k, max(v.n for v in self.views)
        self.x = np.random.default_rng(0).standard_normal((16, k)).astype(np.float32)
        self.y = np.empty((16, n), np.float32)
        self.codes = [np.full(PLAN_ROWS, c, np.uint8) for c in range(N_CODES)]

    def __call__(self, code: int, m: int) -> float:
        """Seconds a call of ``m`` rows takes, the mean over the next SAMPLE_VIEWS views (or all there are)."""
        n = min(SAMPLE_VIEWS, len(self.views))
        views = [self.views[(self.i + j) % len(self.views)] for j in range(n)]
        self.i += n
        for v in views:
            v.plan = self.codes[code].ctypes.data
        t0 = time.perf_counter_ns()
        for v in views:
            self.lib.prunus_linear(ctypes.byref(v), self.pool, m, self.x.ctypes.data, self.y.ctypes.data)
        return (time.perf_counter_ns() - t0) / 1e9 / n


def _fastest(timer: _Timer, kind: str, m: int) -> int:
    """The fastest grouping for ``m`` rows: the fixed rule unless another beats it by more than MARGIN."""
    cands = candidates(kind, m)
    best = {c: float("inf") for c in cands}
    for rep in range(REPS):
        for c in (cands if rep % 2 == 0 else cands[::-1]):
            best[c] = min(best[c], timer(c, m))
    rule = fixed_rule(kind, m)
    top = min(best, key=best.get)
    if rule in best and best[top] > best[rule] * (1 - MARGIN):
        return rule
    return top


def calibrate(packed: PackedModel, lib, pool, budget_s: float = BUDGET_S) -> tuple[dict[str, list[int]], bool]:
    """Each shape's groupings by row count, timed here (:func:`_fastest`); and whether every bucket was measured
    within ``budget_s`` (those left keep the fixed rules). Shapes with the most weight bytes go first."""
    deadline = time.perf_counter() + budget_s
    plans, complete = {}, True
    shapes = sorted(by_shape(packed).items(), key=lambda kv: -sum(lin.w.nbytes for lin in kv[1]))
    for key, lins in shapes:  # the most bytes a pass first: what the budget leaves out matters least
        kind = lins[0].kind
        plan = [fixed_rule(kind, m) for m in range(PLAN_ROWS)]
        plans[key] = plan
        if max(lin.w.nbytes for lin in lins) < MIN_BYTES:
            continue
        timer = _Timer(lib, pool, lins)
        timer(plan[2], 2)  # warm-up: the first call pays for its pages and the pool's wake-up
        for m, rows in BUCKETS.items():
            if time.perf_counter() > deadline:
                complete = False
                break
            code = _fastest(timer, kind, m)
            for r in rows:
                plan[r] = code
    return plans, complete


# --- the cache -------------------------------------------------------------------------------------------------------

def plan_key(lib, isa: str, threads: int, packed: PackedModel) -> dict:
    """What a plan is measured for: the CPU, the kernel library's bytes, the kernel path, the threads, the shapes."""
    from prunus.artifacts.manifest_schema import sha256_file

    return {"cpu": cpu_model(), "library": sha256_file(Path(lib._name)), "isa": isa, "threads": int(threads),
            "shapes": sorted(by_shape(packed))}


def plan_path(key: dict) -> Path:
    from prunus.artifacts.cache_dir import xdg_base

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return xdg_base() / "native" / "plans" / f"plan-{digest}.json"


def read_plan_file(path: Path) -> dict:
    """The cached file's JSON object, read without following a symlink, bounded; ValueError saying why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ValueError("missing") from None
    except OSError as e:
        raise ValueError("a symlink" if os.path.islink(path) else f"unreadable ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ValueError("not a plain file of this user's")
        data = f.read(MAX_PLAN_BYTES + 1)
    if len(data) > MAX_PLAN_BYTES:
        raise ValueError(f"larger than {MAX_PLAN_BYTES} bytes")
    try:
        obj = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ValueError("not valid JSON") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj


def plan_problem(obj: dict, key: dict) -> str | None:
    """Why a cached plan does not serve ``key`` (a phrase), or None."""
    if obj.get("format") != PLAN_FORMAT:
        return f"not a {PLAN_FORMAT} file"
    saved = obj.get("key") if isinstance(obj.get("key"), dict) else {}
    if saved.get("cpu") != key["cpu"]:
        return f"measured on another CPU ({str(saved.get('cpu'))[:80]})"
    if saved.get("library") != key["library"]:
        return "measured with another kernel library"
    if saved != key:
        return "measured for another kernel path, thread count or model"
    plans = obj.get("plans")
    if not isinstance(plans, dict) or sorted(plans) != key["shapes"]:
        return "damaged (its shapes are not the model's)"
    for v in plans.values():
        if (not isinstance(v, list) or len(v) != PLAN_ROWS
                or not all(type(c) is int and 0 <= c < N_CODES for c in v)):
            return "damaged (an entry is no grouping)"
    return None


def _write_plan(tmp: Path, obj: dict) -> None:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write((json.dumps(obj) + "\n").encode())


def _cached(path: Path, key: dict) -> tuple[Plan | None, str]:
    """The plan cached at ``path`` for ``key``, or None and why not."""
    try:
        obj = read_plan_file(path)
    except ValueError as e:
        return None, str(e)
    why = plan_problem(obj, key)
    return (Plan(obj["plans"], f"cached ({path})"), "") if why is None else (None, why)


def _measured(packed: PackedModel, lib, pool, key: dict, path: Path, why: str) -> Plan:
    """Calibrate, and cache the result at ``path`` (under its lock, replacing whatever is there)."""
    from prunus.artifacts.cache_dir import locked, replace_entry

    with locked(path.with_name(f".{path.name}.lock"), FIX):
        if why != f"{PLAN_ENV}=calibrate":
            done, _ = _cached(path, key)  # another process may have measured it meanwhile
            if done is not None:
                return done
        t0 = time.perf_counter()
        plans, complete = calibrate(packed, lib, pool)
        took = time.perf_counter() - t0
        replace_entry(path, lambda tmp: _write_plan(tmp, {"format": PLAN_FORMAT, "key": key, "plans": plans,
                                                          "complete": complete, "seconds": round(took, 3)}))
    left = "" if complete else ", the budget spent: the rest keep the fixed rules"
    again = "" if why == "missing" else f"; the cached plan was {why}: measured again"
    return Plan(plans, f"calibrated ({len(plans)} shapes in {took:.2f} s{left}; cached in {path}){again}")


def plan_mode() -> str:
    """``PRUNUS_NATIVE_PLAN``: auto (cached, else measured; the default), off (the fixed rules) or calibrate."""
    mode = os.environ.get(PLAN_ENV, "").strip().lower() or "auto"
    if mode not in MODES:
        raise PrunusError(f"{PLAN_ENV}={mode}: not a plan mode; set it to one of {', '.join(MODES)}, or unset it")
    return mode


def load_plan(packed: PackedModel, lib, pool, isa: str, threads: int) -> Plan:
    """The groupings a decoder over ``packed`` runs with (see the module docstring); never raises for the cache:
    a cache dir that cannot be used is one phrase in the plan's ``how`` and the plan is measured all the same."""
    from prunus.artifacts.cache_dir import safe_dir, xdg_base

    mode = plan_mode()
    if mode == "off":
        return Plan(how=f"default ({PLAN_ENV}=off)")
    if lib.prunus_isa_invariant(isa.encode()) != 1:
        return Plan(how=f"default (the {isa} path is not batch invariant)")
    key = plan_key(lib, isa, threads, packed)
    path = plan_path(key)
    try:
        safe_dir(path.parent, xdg_base(), FIX)
        plan, why = _cached(path, key) if mode == "auto" else (None, f"{PLAN_ENV}=calibrate")
        return plan if plan is not None else _measured(packed, lib, pool, key, path, why)
    except (PrunusError, OSError) as e:
        plans, _ = calibrate(packed, lib, pool)
        return Plan(plans, f"calibrated, not cached ({str(e)[:200]})")
