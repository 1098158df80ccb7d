"""Compiling and loading ``decode.c``: once per source and compiler, into ``$XDG_CACHE_HOME/prunus/native``.

The library is built on first use with the machine's C compiler (``$CC``, else ``cc``) for AVX2 + FMA + F16C, like
torch's own JIT extensions: no build step at install, nothing compiled when the native decoder is never asked for.
The file name carries a hash of the sources and the command, so an edited source or another compiler builds anew;
a build is written under a temporary name and renamed into place, so two processes never load a half-written one.

The same library holds the linear kernels of several ISAs (:data:`ISAS`; the AVX-512, VNNI and AMX ones are
compiled with gcc's target attributes) and picks one at load from the CPU: the first of :data:`ISAS` it has, or
the one ``PRUNUS_NATIVE_ISA`` names (to compare paths, or to test one).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from prunus.artifacts.errors import PrunusError

SOURCE = Path(__file__).with_name("decode.c")
HEADERS = ("tile_quant256.h", "tile_f32_512.h", "tile_quant512.h", "tile_amx.h")  # the kernel templates decode.c includes
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-shared", "-pthread", "-std=c11"]
ABI = 4  # prunus_abi() of the source this module's structures match
ISAS = ("amx", "avx512vnni", "avx512", "avxvnni", "avx2")  # the kernel paths, in the order they are preferred
ISA_ENV = "PRUNUS_NATIVE_ISA"


def cpu_supported() -> str | None:
    """None when this CPU runs the kernels, else why not (one phrase)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"an x86-64 CPU with AVX2 (this is {platform.machine()})"
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return "/proc/cpuinfo to check for AVX2 (not readable here)"
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags.split()]
    return f"a CPU with {', '.join(missing)} (this one lacks it)" if missing else None


def _cache_dir() -> Path:
    home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return home / "prunus" / "native"


def _compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC", "cc"))
    if not cc or shutil.which(cc[0]) is None:
        raise PrunusError(f"the native decoder is compiled on first use and no C compiler was found ({' '.join(cc) or 'CC'}); "
                          "install gcc or set CC, or serve without --native")
    return cc


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """The compiled kernels (built if missing), with their functions' argument types set."""
    why = cpu_supported()
    if why is not None:
        raise PrunusError(f"the native decoder needs {why}; serve without --native")
    cc = _compiler()
    source = b"".join(SOURCE.with_name(name).read_bytes() for name in (SOURCE.name, *HEADERS))
    key = hashlib.sha256(source + " ".join(cc + FLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"prunus-decode-{key}.so"
    if not target.is_file():
        _build(cc, target)
    lib = ctypes.CDLL(str(target))
    if lib.prunus_abi() != ABI:
        raise PrunusError(f"{target}: built from another version of decode.c; delete it and retry")
    _declare(lib)
    _choose_isa(lib, os.environ.get(ISA_ENV, "").strip())
    return lib


def _choose_isa(lib: ctypes.CDLL, forced: str) -> None:
    """The CPU's preferred kernel path, or the one ``PRUNUS_NATIVE_ISA`` forces (one PrunusError line when it is no
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
    """The kernel paths this CPU runs, preferred first."""
    lib = lib or library()
    return [name for name in ISAS if lib.prunus_isa_supported(name.encode()) == 1]


def isa() -> str:
    """The kernel path the linear layers run now (``avx2``, ``avxvnni``, ``avx512``, ``avx512vnni``, ``amx``)."""
    return library().prunus_isa().decode()


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


def _build(cc: list[str], target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as e:
        raise PrunusError(f"the native kernels are compiled into {target.parent}, which cannot be written "
                          f"({e.strerror}); set XDG_CACHE_HOME to a writable dir, or serve without --native") from None
    os.close(fd)
    try:
        done = subprocess.run([*cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[0][:200]
            raise PrunusError(f"compiling {SOURCE.name} failed ({first}); serve without --native")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.prunus_pool_new.restype = p
    lib.prunus_pool_new.argtypes = [i]
    lib.prunus_pool_free.argtypes = [p]
    lib.prunus_forward.restype = i
    lib.prunus_forward.argtypes = [p, p, i, i, p, p, p, i, p, i]
    lib.prunus_linear.argtypes = [p, p, i, p, p]
    for name in ("prunus_isa", "prunus_best_isa", "prunus_isa_name"):
        getattr(lib, name).restype = ctypes.c_char_p
    lib.prunus_isa_name.argtypes = [i]
    lib.prunus_isa_supported.argtypes = lib.prunus_set_isa.argtypes = [ctypes.c_char_p]
    lib.prunus_isa_supported.restype = lib.prunus_set_isa.restype = i
