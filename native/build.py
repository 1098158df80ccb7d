"""Compiling and loading ``decode.c``: once per source and compiler, into ``$XDG_CACHE_HOME/prunus/native``.

The library is built on first use with the machine's C compiler (``$CC``, else ``cc``) for AVX2 + FMA + F16C, like
torch's own JIT extensions: no build step at install, nothing compiled when the native decoder is never asked for.
A build is a dir ``prunus-decode-KEY`` (:mod:`prunus.artifacts.cache_dir`: ``0o700``, never followed through a
symlink) holding the library and ``build.json``, its record: the hash of the sources, the compiler (its command,
the file it resolves to, that file's size and time), the flags, and the library's SHA-256. KEY is a hash of the
record's first four, so an edited source or another compiler builds anew. The library is loaded only when the
record matches and the library's bytes hash as it records (well under a millisecond); anything else in its place
(a planted library, a damaged or half-written build) is built again under a lock, in a temporary dir renamed
into place, so a process never loads what prunus did not build.

The same library holds the linear kernels of several ISAs (:data:`ISAS`; the AVX-512, VNNI and AMX ones are
compiled with gcc's target attributes) and picks one at load from the CPU: the first of :data:`ISAS` it has, or
the one ``PRUNUS_NATIVE_ISA`` names (to compare paths, or to test one).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

from prunus.artifacts.cache_dir import entry_problem, safe_dir, verified_or_rebuilt, xdg_base
from prunus.artifacts.errors import PrunusError

SOURCE = Path(__file__).with_name("decode.c")
HEADERS = ("tile_quant256.h", "tile_f32_512.h", "tile_quant512.h", "tile_amx.h")  # the kernel templates decode.c includes
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-shared", "-pthread", "-std=c11"]
ABI = 9  # prunus_abi() of the source this module's structures match
ISAS = ("amx", "avx512vnni", "avx512", "avxvnni", "avx2")  # the kernel paths, widest first (default: default_isa)
ISA_ENV = "PRUNUS_NATIVE_ISA"
LIB, RECORD = "decode.so", "build.json"
BUILD_FORMAT = "prunus-native-build/1"
FIX = "or set XDG_CACHE_HOME to a dir of your own, or serve without --native"


def cpu_model() -> str:
    """The CPU's model name, from /proc/cpuinfo or lscpu; the platform's word for it elsewhere (for reports,
    benchmark figures and cache keys)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_supported() -> str | None:
    """None when this CPU runs the kernels, else why not (one phrase)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"an x86-64 CPU with AVX2 (this is {platform.machine()})"
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return "/proc/cpuinfo to check for AVX2 (not readable here)"
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags.split()]
    return f"a CPU with {', '.join(missing)} (this one lacks it)" if missing else None


def _cache_dir() -> Path:
    return xdg_base() / "native"


def _compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC", "cc"))
    if not cc or shutil.which(cc[0]) is None:
        raise PrunusError(f"the native decoder is compiled on first use and no C compiler was found ({' '.join(cc) or 'CC'}); "
                          "install gcc or set CC, or serve without --native")
    return cc


def build_record(cc: list[str]) -> dict:
    """What a build is made from: the sources' hash, the compiler (command, resolved file, its size and time: a
    ``stat``, no process started) and the flags."""
    try:
        source = b"".join(SOURCE.with_name(name).read_bytes() for name in (SOURCE.name, *HEADERS))
    except OSError as e:  # an install without the package data: one line, which native="auto" falls back on
        raise PrunusError(f"the native decoder's source {e.filename} cannot be read ({e.strerror}); reinstall "
                          "prunus, or serve without --native") from None
    exe = os.path.realpath(shutil.which(cc[0]) or cc[0])
    st = os.stat(exe)
    return {"format": BUILD_FORMAT, "source": hashlib.sha256(source).hexdigest(),
            "compiler": [*cc, exe, st.st_size, st.st_mtime_ns], "flags": FLAGS}


def build_dir(record: dict) -> Path:
    """The build dir of ``record``: named by a hash of it."""
    key = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
    return _cache_dir() / f"prunus-decode-{key}"


def build_problem(entry: Path, record: dict) -> str | None:
    """Why the build dir ``entry`` may not be loaded for ``record`` (a phrase), or None."""
    from prunus.artifacts.manifest_schema import sha256_file
    from prunus.artifacts.validate import read_json_object

    why = entry_problem(entry)
    if why is not None:
        return why
    try:
        saved = read_json_object(entry / RECORD, fix="it is built again")
    except PrunusError as e:
        return str(e).split("; ")[0]
    if {k: saved.get(k) for k in record} != record:
        return "built from other sources, flags or compiler"
    digest = (saved.get("files") or {}).get(LIB) if isinstance(saved.get("files"), dict) else None
    if not (entry / LIB).is_file() or sha256_file(entry / LIB) != digest:
        return f"{LIB} does not hash as {RECORD} records"
    return None


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """The compiled kernels (built if missing or not verified), with their functions' argument types set."""
    why = cpu_supported()
    if why is not None:
        raise PrunusError(f"the native decoder needs {why}; serve without --native")
    cc = _compiler()
    record = build_record(cc)
    entry = build_dir(record)
    root = safe_dir(entry.parent, xdg_base(), FIX)
    verified_or_rebuilt(entry, lambda p: build_problem(p, record), lambda tmp: _build(cc, record, tmp),
                        root / f".{entry.name}.lock", FIX)
    lib = ctypes.CDLL(str(entry / LIB))  # verified just now, in a dir only this user writes
    if lib.prunus_abi() != ABI:
        raise PrunusError(f"{entry / LIB}: its ABI is {lib.prunus_abi()}, not the {ABI} prunus expects (decode.c and "
                          "build.py disagree); reinstall prunus")
    _declare(lib)
    _choose_isa(lib, os.environ.get(ISA_ENV, "").strip())
    return lib


def _choose_isa(lib: ctypes.CDLL, forced: str) -> None:
    """The CPU's default kernel path (:func:`default_isa`), or the one ``PRUNUS_NATIVE_ISA`` forces (one PrunusError line when it is no
    path or this CPU lacks it)."""
    if not forced:
        lib.prunus_set_isa(lib.prunus_best_isa())
        return
    rc = lib.prunus_set_isa(forced.encode())
    if rc == -1:
        raise PrunusError(f"{ISA_ENV}={forced}: not a native kernel path; set it to one of {', '.join(ISAS)}, "
                          "or unset it to let the CPU choose")
    if rc == -2:
        raise PrunusError(f"{ISA_ENV}={forced}: this CPU has no {forced}; set it to one of "
                          f"{', '.join(supported_isas(lib))}, or unset it to let the CPU choose")


def supported_isas(lib: ctypes.CDLL | None = None) -> list[str]:
    """The kernel paths this CPU runs, widest first."""
    lib = lib or library()
    return [name for name in ISAS if lib.prunus_isa_supported(name.encode()) == 1]


def isa() -> str:
    """The kernel path the linear layers run now (``avx2``, ``avxvnni``, ``avx512``, ``avx512vnni``, ``amx``)."""
    return library().prunus_isa().decode()


def default_isa() -> str:
    """The path a load runs unless ``PRUNUS_NATIVE_ISA`` names another: the first batch-invariant one this CPU runs."""
    return library().prunus_best_isa().decode()


def batch_invariant(name: str | None = None) -> bool:
    """Whether kernel path ``name`` (default: the one running) gives a row the same bits whatever rows share its pass:
    AVX2 and AVX-VNNI, the default wherever the CPU has them; the 512-bit and AMX paths only when asked for by name."""
    lib = library()
    return lib.prunus_isa_invariant((name or isa()).encode()) == 1


def set_isa(name: str) -> str:
    """Run the linear layers with path ``name`` from now on, in this process (for tests and comparisons); returns
    the path it replaces. Raises ValueError when ``name`` is no path or this CPU lacks it."""
    lib, before = library(), isa()
    rc = lib.prunus_set_isa(name.encode())
    if rc != 0:
        raise ValueError(f"{name}: {'not a kernel path' if rc == -1 else 'this CPU lacks it'}")
    return before


def isa_missing(name: str) -> str | None:
    """None when this CPU runs path ``name``, else why not (for skipping a test of it)."""
    why = unavailable()
    if why is not None:
        return why
    return None if name in supported_isas() else f"this CPU has no {name}"


def unavailable() -> str | None:
    """None when the kernels build and load here, else the one-line reason (for skipping what needs them)."""
    try:
        library()
    except PrunusError as e:
        return str(e)
    return None


def _build(cc: list[str], record: dict, tmp: Path) -> None:
    """Compile the library into the new build dir ``tmp`` and record it (:func:`build_record`)."""
    from prunus.artifacts.atomic import atomic_write_json
    from prunus.artifacts.manifest_schema import sha256_file

    try:
        tmp.mkdir(mode=0o700)
    except OSError as e:
        raise PrunusError(f"the native kernels are compiled into {tmp.parent}, which cannot be written "
                          f"({e.strerror}); fix its permissions, {FIX}") from None
    done = subprocess.run([*cc, *FLAGS, str(SOURCE), "-o", str(tmp / LIB), "-lm"], capture_output=True, text=True)
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["no output"])[0][:200]
        raise PrunusError(f"compiling {SOURCE.name} failed ({first}); serve without --native")
    atomic_write_json(tmp / RECORD, {**record, "files": {LIB: sha256_file(tmp / LIB)}})


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.prunus_pool_new.restype = p
    lib.prunus_pool_new.argtypes = [i]
    lib.prunus_pool_free.argtypes = [p]
    lib.prunus_forward.restype = i
    lib.prunus_forward.argtypes = [p, p, i, i, p, p, p, i, p, i, p]
    lib.prunus_forward_at.restype = i
    lib.prunus_forward_at.argtypes = [p, p, i, i, p, p, p, p, p, i, p]
    lib.prunus_forward_x.restype = i
    lib.prunus_forward_x.argtypes = [p, p, i, p, p, p, p, p, i, p]
    lib.prunus_linear.argtypes = [p, p, i, p, p]
    for name in ("prunus_isa", "prunus_best_isa", "prunus_isa_name"):
        getattr(lib, name).restype = ctypes.c_char_p
    lib.prunus_isa_name.argtypes = [i]
    lib.prunus_isa_supported.argtypes = lib.prunus_set_isa.argtypes = [ctypes.c_char_p]
    lib.prunus_isa_supported.restype = lib.prunus_set_isa.restype = i
    lib.prunus_isa_invariant.argtypes, lib.prunus_isa_invariant.restype = [ctypes.c_char_p], i
    lib.prunus_plan_rows.argtypes, lib.prunus_plan_rows.restype = [], i
