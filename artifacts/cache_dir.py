"""The caches prunus keeps for itself (prepared exports, compiled kernels, TensorRT timings): the rules every one
keeps, so that nothing in a cache is used unless it is what prunus itself wrote there from what it derives from.

* :func:`safe_dir`: the cache dir, created ``0o700`` (and every dir from its base down); a symlink, something that
  is not a dir, or a dir of another user anywhere from the base down is refused in one line, never followed; a
  prunus-owned dir with wider permissions is narrowed to ``0o700``.
* :func:`locked`: the lock file two processes filling the same entry take turns on: created ``0o600`` with
  ``O_CREAT | O_EXCL | O_NOFOLLOW``, or opened with ``O_NOFOLLOW``; a symlink (or anything but a regular file of
  this user) at its path is refused, never created through.
* :func:`entry_problem`: why an entry cannot be used as it stands (missing, a symlink, not a plain dir of this
  user's plain files); the caller's own check (its manifest: lineage, file hashes) comes after.
* :func:`verified_or_rebuilt`: the entry when its check passes, else rebuilt under the lock
  (:func:`replace_entry`: into a temporary name beside it, fsynced, ``0o700`` / ``0o600``, and renamed over it
  with :func:`prunus.artifacts.atomic.replace_dir`: the old entry, a symlink included, is renamed away, never
  followed or written through). A killed build leaves only a temporary that the next build removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .atomic import _fsync_dir, clean_stale_temps, replace_dir
from .errors import PrunusError

DIR_MODE, FILE_MODE = 0o700, 0o600


def cache_base() -> Path:
    """``$PRUNUS_CACHE_DIR``, else ``~/.cache/prunus``: the base of the caches prunus keeps by artifact (prepared
    exports, the native kernels' parity verdicts on model dirs)."""
    return Path(os.environ.get("PRUNUS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "prunus"))


def xdg_base() -> Path:
    """``$XDG_CACHE_HOME/prunus`` (default ``~/.cache/prunus``): the base of the caches prunus keeps by machine
    (compiled kernels, TensorRT timings)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prunus"


def _refusal(st: os.stat_result) -> str | None:
    """Why what ``st`` (an lstat) describes is no cache dir of this user's, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink (a cache dir is never followed)"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return "belongs to another user"
    return None


def safe_dir(path: Path, base: Path, fix: str) -> Path:
    """``path`` (``base`` or a dir under it) as a dir of this user's, mode ``0o700`` below ``base``; created where
    missing. ``base`` itself may not be writable by others (it is narrowed only when prunus creates it). One
    PrunusError line naming the dir otherwise, ending "remove it, {fix}" (``fix``: the other way out, "or set
    ENV to a dir of your own")."""
    path, base = Path(path), Path(base)
    d = base
    for i, part in enumerate(("", *_below(path, base))):
        d = d / part if part else d
        try:
            _one_dir(d, own=i > 0, fix=fix)
        except OSError as e:
            raise PrunusError(f"{d}: cannot be written as a cache dir ({e.strerror or e}); fix its permissions, "
                              f"{fix}") from None
    return path


def _one_dir(d: Path, own: bool, fix: str) -> None:
    """One dir of :func:`safe_dir`: created ``0o700`` when missing; ``own`` (prunus's): narrowed to ``0o700``."""
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        d.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        os.mkdir(d, DIR_MODE)
        st, own = os.lstat(d), True
    why = _refusal(st)
    if why is not None:
        raise PrunusError(f"{d}: {why}; remove it, {fix}")
    if not own and st.st_mode & 0o022:
        raise PrunusError(f"{d}: is writable by other users; chmod go-w it, {fix}")
    if own and stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(d, DIR_MODE)


def _below(path: Path, base: Path) -> tuple[str, ...]:
    try:
        return path.relative_to(base).parts
    except ValueError:
        raise ValueError(f"{path} is not under {base}") from None


def _open_lock(path: Path) -> int:
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(3):  # removed between the two opens: try again
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, FILE_MODE)
        except FileExistsError:
            pass
        try:
            return os.open(path, flags | os.O_NONBLOCK)  # a FIFO planted there must not block the open
        except FileNotFoundError:
            continue
    raise FileNotFoundError(path)


@contextlib.contextmanager
def locked(path: Path, fix: str):
    """Hold an exclusive lock on the lock file ``path`` (see the module docstring)."""
    try:
        fd = _open_lock(path)
    except OSError as e:
        what = ("is a symlink (a lock file is never created through one)" if os.path.islink(path) else
                f"cannot be opened as a lock file ({e.strerror or e})")
        raise PrunusError(f"{path}: {what}; remove it, {fix}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PrunusError(f"{path}: is not a lock file of this user's; remove it, {fix}")
        if stat.S_IMODE(st.st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def entry_problem(entry: Path) -> str | None:
    """Why ``entry`` cannot be used as it stands (a phrase), or None: a real dir of this user's holding only
    regular files and dirs, no symlink anywhere in it."""
    try:
        st = os.lstat(entry)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    why = _refusal(st)
    if why is not None:
        return why.split(" (")[0]
    for root, dirs, files in os.walk(entry):  # os.walk never descends into a symlinked dir
        for name in dirs + files:
            try:
                mode = os.lstat(os.path.join(root, name)).st_mode
            except OSError:
                return f"changed while it was read ({name})"
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                return f"holds {name}, which is not a plain file"
    return None


def _seal(path: Path) -> None:
    """fsync a finished entry (a dir or a file) and give it ``0o700`` dirs and ``0o600`` files."""
    if path.is_file() and not path.is_symlink():
        os.chmod(path, FILE_MODE)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        return
    for root, _, files in os.walk(path):
        for name in files:
            f = os.path.join(root, name)
            if not os.path.islink(f):
                os.chmod(f, FILE_MODE)
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        os.chmod(root, DIR_MODE)
        _fsync_dir(Path(root))


def remove_entry(path: Path) -> None:
    """Remove ``path`` without following it: a symlink or file is unlinked, a dir removed with what it holds
    (``shutil.rmtree`` does not follow the links inside)."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


@dataclass
class Outcome:
    path: Path
    cached: bool  # True: the entry was there and passed its check
    reason: str | None = None  # why it was rebuilt ("missing" for a first build)


def verified_or_rebuilt(entry: Path, check: Callable[[Path], str | None], build: Callable[[Path], None],
                        lock: Path, fix: str, announce: Callable[[str], None] | None = None) -> Outcome:
    """``entry`` when ``check(entry)`` is None (it verifies), else rebuilt: under ``lock``, checked again (another
    process may have rebuilt it meanwhile), then :func:`replace_entry`. ``announce(reason)`` runs before a build."""
    why = check(entry)
    if why is None:
        return Outcome(entry, True)
    with locked(lock, fix):
        why = check(entry)
        if why is None:
            return Outcome(entry, True)
        if announce is not None:
            announce(why)
        replace_entry(entry, build)
    return Outcome(entry, False, why)


def replace_entry(entry: Path, build: Callable[[Path], None]) -> None:
    """``build(tmp)`` writes a dir or a file at ``tmp``, a temporary name beside ``entry``; it is sealed (fsynced,
    ``0o700`` / ``0o600``) and renamed over ``entry``, whatever ``entry`` was (a symlink is renamed away, never
    followed). The caller holds the entry's lock."""
    clean_stale_temps(entry.parent)
    tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}")
    remove_entry(tmp)
    try:
        build(tmp)
        _seal(tmp)
        replace_dir(tmp, entry)
    finally:
        with contextlib.suppress(OSError):
            remove_entry(tmp)
