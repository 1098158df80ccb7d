"""Atomic writes: a killed process never leaves a half-written artifact that looks complete.

Files and directories are written under a temporary sibling name (``.NAME.tmp-PID``),
fsynced, then renamed into place (rename is atomic on POSIX within one filesystem).
Replacing a directory keeps the old one (as ``.NAME.old-PID``) until the new one is in
place, so a crash at any moment leaves the old artifact or the new one, never neither.

Temporary names left by a killed process (its PID no longer runs) are cleaned up by the
next write into the same parent: a ``.tmp-PID`` is removed; an ``.old-PID`` whose
artifact is missing (killed between the two renames) is renamed back. Written files get
the permissions the umask gives every other file (some writers, safetensors among them,
create theirs 0600).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from pathlib import Path

from .errors import PrunusError
from .pids import pid_alive

_TEMP = re.compile(r"^\.(.+)\.(tmp|old)-(\d+)$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _finish_tree(path: Path) -> None:
    """fsync every file and dir under ``path`` and give them the umask's permissions."""
    mask = _umask()
    for root, _, files in os.walk(path):
        for name in files:
            f = os.path.join(root, name)
            if os.path.islink(f):
                continue
            os.chmod(f, 0o666 & ~mask)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(root, 0o777 & ~mask)
        _fsync_dir(Path(root))


def clean_stale_temps(parent: str | Path) -> list[Path]:
    """Remove ``.X.tmp-PID`` entries of dead processes in ``parent``; restore an orphaned ``.X.old-PID``
    whose ``X`` is missing. Returns what was removed or restored."""
    parent = Path(parent)
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    done = []
    for name in names:
        m = _TEMP.match(name)
        if not m or pid_alive(int(m.group(3))):
            continue
        entry, target = parent / name, parent / m.group(1)
        try:
            if m.group(2) == "old" and not os.path.lexists(target):
                entry.rename(target)
            elif entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            done.append(entry)
        except OSError:
            pass
    return done


_DISK_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                errno.EROFS: "read-only file system", errno.EFBIG: "file too large"}


class WriteRefused(PrunusError):
    """A write the disk refused (full, over quota, read-only), as one line; ``reason`` says which, so a caller
    that knows more about what is left on disk can say so."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


def disk_error(e: BaseException) -> str | None:
    """A short reason when ``e`` says the disk refused a write (full, quota, read-only), else None.
    Covers OSError, writers that wrap it in their own exception (safetensors), and :class:`WriteRefused`."""
    if isinstance(e, WriteRefused):
        return e.reason
    if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
        return _DISK_ERRNOS[e.errno]
    text = str(e)
    for code, reason in _DISK_ERRNOS.items():
        if f"code: {code}," in text or os.strerror(code) in text:
            return reason
    return None


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def replace_dir(tmp: Path, path: Path) -> None:
    """Move the finished directory ``tmp`` to ``path``, replacing what was there only once ``tmp`` is in place."""
    old = None
    if os.path.lexists(path):
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        path.rename(old)
    try:
        tmp.rename(path)
    except BaseException:
        if old is not None:
            old.rename(path)
        raise
    _fsync_dir(path.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


def writable_parent(path: Path, flag: str = "--out") -> None:
    """Create ``path``'s parent, or one PrunusError line when it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PrunusError(f"{flag} {path}: cannot create {path.parent} ({e.strerror}); choose another {flag}") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise PrunusError(f"{flag} {path}: {path.parent} is not writable; choose another {flag}")


@contextlib.contextmanager
def atomic_dir(path: str | Path, overwrite: bool = False):
    """Yield a temporary directory; on success it becomes ``path``, on error it is removed.

    An existing ``path`` is refused unless ``overwrite``, and even then only when it is
    a prunus output (see :func:`prunus.artifacts.paths.check_replaceable`); it stays in place
    until the new directory is complete."""
    from .paths import check_replaceable

    path = Path(path)
    if os.path.lexists(path):
        if not overwrite:
            raise PrunusError(f"{path}: already exists; choose another output path or pass --overwrite")
        check_replaceable(path)
    writable_parent(path)
    clean_stale_temps(path.parent)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with discard_on_error(tmp, f"{path}: writing failed ({{reason}}); nothing was written, free space or choose "
                               "another --out"):
        try:
            tmp.mkdir()
        except OSError as e:
            raise PrunusError(f"--out {path}: cannot be created ({e.strerror}); choose another --out") from None
        yield tmp
        _finish_tree(tmp)
    replace_dir(tmp, path)


@contextlib.contextmanager
def discard_on_error(tmp: str | Path, message: str, remove: bool = True):
    """When the block raises, remove ``tmp`` (a half-written output; only where ``remove``) and turn a write the
    disk refused (full, quota, read-only) into one PrunusError line: ``message`` with ``{reason}`` filled in."""
    try:
        yield
    except BaseException as e:
        if remove:
            shutil.rmtree(tmp, ignore_errors=True)
        reason = disk_error(e)
        if reason:
            raise WriteRefused(message.replace("{reason}", reason), reason) from None
        raise
