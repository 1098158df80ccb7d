"""The native kernels' own parity record: whether they can be checked on this machine, and what an export's check of
them said.

An export is served by the runtime that was checked: ``prunus export`` (and a model dir's prepared export) scores
the genai graph in ONNX Runtime *and* in prunus's native kernels on this CPU's kernel path against the PyTorch model,
with the same limits (:mod:`prunus.export.served_parity`), and writes both under ``runtimes`` in ``parity.json``.
At load, ``native="auto"`` does not choose kernels whose recorded check failed (:func:`recorded_native_off`); the
engine's info and ``prunus info`` show each runtime's figures (:func:`native_parity_line`).
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


def recorded_native_off(export_dir: Path) -> str | None:
    """Why ``native="auto"`` must not choose the kernels for this export: their recorded parity check failed."""
    native = runtime_parity(export_dir).get("native")
    if not isinstance(native, dict) or native.get("passed") is not False:
        return None
    tol = native.get("tolerances") or {}
    bad = ", ".join(f"{k} {_num(native.get(k), '.4g')} (limit {tol.get(k)})" for k in native.get("failed") or [])
    return f"the export's parity check failed on the native kernels ({native.get('isa')}: {bad or 'no figures'})"


def native_parity_line(export_dir: Path) -> str:
    """One line for the engine's info: what the export's check of the native kernels found, and on which path."""
    native = runtime_parity(export_dir).get("native")
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
