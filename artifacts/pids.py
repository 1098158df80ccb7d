"""Whether a process id still runs: for temp names of killed writers and for peers of a shared all-reduce;
and the cleaning of temporaries named after a process that died without removing them (at the next start,
or by the dead process's own helpers).

It lives in ``artifacts/`` because atomic writes (:mod:`.atomic`) clean the temporaries of dead writers with
:func:`pid_alive`, and ``artifacts/`` imports nothing above it; the runtime's tensor-parallel workers (temp
dir, shared-memory all-reduce) use the same helpers from here rather than a copy."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs. A zombie (exited, not yet reaped by its parent) counts as gone: it will
    never write or answer again. A process of another user (no permission to signal it) counts as alive."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # Linux: the state follows the parenthesised command name in /proc/PID/stat
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS), or the process went away meanwhile
        return True


def pid_prefix(prefix: str) -> str:
    """The name prefix of this process's temporaries, ``{prefix}{PID}-`` (for ``tempfile.mkdtemp``)."""
    return f"{prefix}{os.getpid()}-"


def remove_stale(parent: str | Path, prefix: str) -> list[Path]:
    """Remove the entries of ``parent`` named ``{prefix}{PID}-...`` (see :func:`pid_prefix`) whose process no
    longer runs and that belong to this user (a process killed with SIGKILL cleans nothing up). Returns them."""
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    return remove_orphaned([Path(parent) / name for name in names], prefix)


def remove_orphaned(entries, prefix: str) -> list[Path]:
    """Remove each of ``entries`` named ``{prefix}{PID}-...`` whose process no longer runs and that belongs to this
    user (a dir, never followed through a symlink, or a file); any other entry stays, above all one of a live
    process. What a dead process's helpers (tensor-parallel workers) clean up for it. Returns those removed."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)-")
    removed = []
    for entry in map(Path, entries):
        m = pattern.match(entry.name)
        if not m or pid_alive(int(m.group(1))):
            continue
        try:
            if entry.lstat().st_uid != os.getuid():
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)  # past what another remover took meanwhile
                if os.path.lexists(entry):
                    continue
            else:
                entry.unlink()
            removed.append(entry)
        except OSError:  # removed meanwhile, or not ours to remove
            pass
    return removed
