"""The native kernels' own parity record: whether they can be checked on this machine, and what an export's check of
them said.

An export is served by the runtime that was checked: ``prunus export`` (and a model dir's prepared export) scores
the genai graph in ONNX Runtime *and* in prunus's native kernels on this CPU's kernel path against the PyTorch model,
with the same limits (:mod:`prunus.export.served_parity`), and writes both under ``runtimes`` in ``parity.json``.
At load, ``native="auto"`` does not choose kernels whose recorded check failed (:func:`recorded_native_off`); the
engine's info and ``prunus info`` show each runtime's figures (:func:`native_parity_line`).

A model dir the native runtime serves directly has no export to record it: ``prunus serve`` checks the kernels on it
once, with the export's limits (:mod:`prunus.export.native_dir_parity`), and keeps the record in prunus's cache,
named by the dir's content hash, this CPU's kernel path and prunus's version (:func:`dir_verdict_path`); a load under
``native="auto"`` reads it there (:func:`recorded_dir_native_off`): kernels whose check of that dir failed, or that
have not been checked on it yet, do not serve it (``native=True`` asks for them by name, checked or not).
"""

from __future__ import annotations

from pathlib import Path

from prunus.artifacts.native_layout import NATIVE_WEIGHTS
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import read_json_object

PARITY = "parity.json"
# How the native integer kernels see a row's activations (docs/native.md): the export's report says so
INT_ACTIVATIONS = "int8 per row in blocks of 32 (amax / 127)"


def native_check_off(export_dir: Path) -> str | None:
    """Why the native kernels cannot be checked (nor serve) here, in a few words; None where they can."""
    from prunus.native.build import cpu_supported, unavailable

    why = cpu_supported()
    if why is not None:
        return f"the native kernels need {why}"
    if not (Path(export_dir) / NATIVE_WEIGHTS).is_file():
        return f"the export has no {NATIVE_WEIGHTS}"
    return unavailable()


def chosen_isa() -> str:
    """This CPU's kernel path, or "none" where the kernels cannot run here."""
    from prunus.native.build import isa, unavailable

    return "none" if unavailable() is not None else isa()


def runtime_parity(export_dir: Path) -> dict:
    """``parity.json``'s per-runtime figures ({} for an export of an older prunus or without a parity report)."""
    path = Path(export_dir) / PARITY
    if not path.is_file():
        return {}
    try:
        report = read_json_object(path, fix="re-export the model")
    except PrunusError:  # unreadable (e.g. a NaN figure of an older prunus): no record of the kernels' check
        return {}
    runtimes = report.get("runtimes")
    return runtimes if isinstance(runtimes, dict) else {}


def _num(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "n/a"


def _failed(native, what: str) -> str | None:
    """Why a failed record ``native`` keeps the kernels off (None: it did not fail)."""
    if not isinstance(native, dict) or native.get("passed") is not False:
        return None
    tol = native.get("tolerances") if isinstance(native.get("tolerances"), dict) else {}
    failed = native.get("failed") if isinstance(native.get("failed"), list) else []
    bad = ", ".join(f"{k} {_num(native.get(k), '.4g')} (limit {tol.get(k)})" for k in failed)
    return f"{what} parity check failed on the native kernels ({native.get('isa')}: {bad or 'no figures'})"


def recorded_native_off(export_dir: Path) -> str | None:
    """Why ``native="auto"`` must not choose the kernels for this export: their recorded parity check failed."""
    return _failed(runtime_parity(export_dir).get("native"), "the export's")


def dir_verdict_path(parent_hash: str) -> Path:
    """Where the native kernels' parity record of a model dir of content hash ``parent_hash`` is kept, for this CPU's
    kernel path and this prunus version."""
    import hashlib

    import prunus
    from prunus.artifacts.cache_dir import cache_base

    key = hashlib.sha256(f"{parent_hash}|{chosen_isa()}|{prunus.__version__}".encode()).hexdigest()[:24]
    return cache_base() / "native-parity" / f"{key}.json"


def dir_parity(model_dir: Path) -> dict | None:
    """The kept parity record of the native kernels on ``model_dir`` (None: not checked on this path yet, or the
    record is unreadable or another dir's)."""
    from prunus.models.model_dir_manifest import dir_hash, read_manifest

    try:
        parent = dir_hash(read_manifest(model_dir)["files"])
        path = dir_verdict_path(parent)
        record = read_json_object(path, fix="remove it") if path.is_file() else None
    except (PrunusError, KeyError, TypeError, AttributeError, OSError):
        return None
    return record if isinstance(record, dict) and record.get("parent") == parent else None


UNCHECKED_DIR = ("the native kernels have not been checked on this model dir on this kernel path yet (prunus serve "
                 "checks it once, as does Engine.load(..., prepare=prunus.export.prepared_path); native=True serves it "
                 "unchecked)")


def recorded_dir_native_off(model_dir: Path) -> str | None:
    """Why ``native="auto"`` must not serve a model dir in the kernels: their kept parity check of it failed, or there
    is none yet (the runtime that serves is the runtime that was checked)."""
    record = dir_parity(model_dir)
    return UNCHECKED_DIR if record is None else _failed(record, "the model dir's")


def dir_parity_line(model_dir: Path) -> str:
    """One line for the engine's info: what the kept check of the native kernels on a model dir found."""
    native = dir_parity(model_dir)
    if native is None:
        return "not checked on this kernel path yet (prunus serve checks a model dir once before serving it natively)"
    return native_parity_line(model_dir, native)


def native_parity_line(export_dir: Path, native: dict | None = None) -> str:
    """One line for the engine's info: what the export's check of the native kernels found (``native``: a record
    given instead), and on which path."""
    native = runtime_parity(export_dir).get("native") if native is None else native
    if not isinstance(native, dict):
        return "not checked (an export of an older prunus: re-export to check the native kernels)"
    if not native.get("checked", True):
        return f"not checked when exported: {native.get('why')}"
    figures = (f"top-1 {_num(native.get('top1_agreement'), '.4f')}, decode agreement "
               f"{_num(native.get('decode_agreement'), '.4f')}, bits/byte {_num(native.get('bpb_increase'), '+.5f')}")
    verdict = "passed" if native.get("passed") else "FAILED"
    here = chosen_isa()
    where = native.get("isa")
    note = "" if where == here else f"; this CPU runs {here}, which that check did not cover"
    return f"{verdict} on {where} ({figures}){note}"
