"""TensorRT's timing cache (the kernel timings its builder measured, which make the next build fast), kept between
exports in ``$XDG_CACHE_HOME/prunus/tensorrt/timing-KEY`` by the rules of :mod:`prunus.artifacts.cache_dir`.

KEY is a hash of the TensorRT version and the GPU's name, what the timings were measured with. The entry is a
``0o700`` dir holding the timings and ``timing.json``, their SHA-256; timings are read only from an entry that
verifies (a plain dir of this user's, its file hashing as recorded), and stored by writing a new entry beside it
and renaming it over the old one under a lock. An entry that does not verify, or a cache dir that cannot be used
(a symlink, another user's), is not read: the build measures again, as it does the first time.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from prunus.artifacts.atomic import atomic_write_json
from prunus.artifacts.cache_dir import entry_problem, locked, replace_entry, safe_dir, xdg_base
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.manifest_schema import sha256_file
from prunus.artifacts.validate import read_json_object

TIMING, RECORD = "tensorrt.timing", "timing.json"
MAX_TIMING_BYTES = 1 << 30
FIX = "or set XDG_CACHE_HOME to a dir of your own"


def timing_entry(tensorrt_version: str, device: str) -> Path:
    """The entry of the timings measured with ``tensorrt_version`` on GPU ``device`` (its dir made safe first:
    one PrunusError line when it cannot be)."""
    root = safe_dir(xdg_base() / "tensorrt", xdg_base(), FIX)
    key = hashlib.sha256(f"{tensorrt_version}|{device}".encode()).hexdigest()[:16]
    return root / f"timing-{key}"


def timing_problem(entry: Path) -> str | None:
    """Why ``entry``'s timings may not be read (a phrase), or None."""
    why = entry_problem(entry)
    if why is not None:
        return why
    try:
        digest = (read_json_object(entry / RECORD, fix="").get("files") or {}).get(TIMING)
    except (PrunusError, AttributeError):
        return f"{RECORD} is not a record of the timings"
    f = entry / TIMING
    if not f.is_file() or f.stat().st_size > MAX_TIMING_BYTES or sha256_file(f) != digest:
        return f"{TIMING} does not hash as {RECORD} records"
    return None


def cached_timings(entry: Path) -> bytes:
    """The stored timings when ``entry`` verifies, else none (``b""``: TensorRT starts an empty cache)."""
    return b"" if timing_problem(entry) is not None else (entry / TIMING).read_bytes()


def store_timings(entry: Path, timings: Path) -> None:
    """Replace ``entry`` with the timings file ``timings`` and its record."""
    def build(tmp: Path) -> None:
        tmp.mkdir(mode=0o700)
        shutil.copyfile(timings, tmp / TIMING)
        atomic_write_json(tmp / RECORD, {"files": {TIMING: sha256_file(tmp / TIMING)}})

    with locked(entry.with_name(f".{entry.name}.lock"), FIX):
        replace_entry(entry, build)
