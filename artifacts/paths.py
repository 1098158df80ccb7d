"""The one check every writer makes: an output never is, contains, or lies inside one of its inputs.

``prunus train --data D --out D --overwrite`` would otherwise clear the corpus, and
``prunus export M --out M --overwrite`` replace the model it reads. Paths are compared
after following symlinks (``Path.resolve``) and, for the parts that exist, by device and
inode too, so a symlinked or bind-mounted route to the same directory is caught as well.
Inputs that do not exist are skipped: they cannot be lost, and their reader says what is
wrong with them.

The same place keeps :func:`check_replaceable`: ``--overwrite`` replaces what prunus
wrote (a model, export, run or Hugging Face dir, or a file), never a directory of
someone else's files.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import PrunusError

# A directory holding one of these was written by prunus (or is a checkpoint prunus writes).
ARTIFACT_MARKERS = ("prunus.json", "run.json", "config.json")


def _ids(path: Path) -> list[tuple[int, int]]:
    """(device, inode) of ``path`` and of every existing ancestor, nearest first."""
    ids = []
    for p in (path, *path.parents):
        try:
            st = p.stat()
        except OSError:
            continue
        ids.append((st.st_dev, st.st_ino))
    return ids


def _overlap(out: Path, inp: Path) -> str | None:
    """How ``out`` overlaps ``inp`` ("is", "contains", "lies inside"), or None."""
    out_r, in_r = out.resolve(), inp.resolve()
    if out_r == in_r:
        return "is"
    if out_r in in_r.parents:
        return "contains"
    if in_r in out_r.parents:
        return "lies inside"
    try:  # the same directory reached another way (bind mount, hard-linked file)
        in_ids = _ids(in_r)
    except OSError:
        return None
    if not in_ids:
        return None
    out_ids = _ids(out_r)
    exists = out_r.exists()
    if exists and out_ids and out_ids[0] == in_ids[0]:
        return "is"
    if in_r.is_dir() and in_ids[0] in (out_ids[1:] if exists else out_ids):
        return "lies inside"
    if exists and out_r.is_dir() and out_ids[0] in in_ids[1:]:
        return "contains"
    return None


def check_output(out: str | Path, inputs, *, flag: str = "--out") -> None:
    """Raise a one-line PrunusError when ``out`` is, contains or lies inside any of ``inputs``.

    ``inputs``: paths (str or Path; None and missing paths are skipped), or (label, path)
    pairs where the label names the input in the message (e.g. "--data")."""
    out = Path(out)
    for item in inputs:
        label, path = item if isinstance(item, tuple) else (None, item)
        if path is None or str(path) == "":
            continue
        path = Path(path)
        try:
            if not path.exists():
                continue
            how = _overlap(out, path)
        except (OSError, RuntimeError):  # a symlink loop: the reader reports it
            continue
        if how is not None:
            what = f"the input {label} {path}" if label else f"the input {path}"
            raise PrunusError(f"{flag} {out}: {how} {what}; writing there would destroy it, choose an {flag} "
                              "outside every input")


def check_replaceable(path: str | Path, *, flag: str = "--out") -> None:
    """Raise when ``--overwrite`` would replace a non-empty directory that prunus did not write."""
    path = Path(path)
    if not path.is_dir() or path.is_symlink():
        return
    try:
        entries = os.listdir(path)
    except OSError as e:
        raise PrunusError(f"{flag} {path}: cannot be read ({e.strerror}); fix its permissions or choose another {flag}") from None
    if entries and not any(m in entries for m in ARTIFACT_MARKERS):
        raise PrunusError(f"{flag} {path}: holds {len(entries)} file(s) prunus did not write; --overwrite only replaces "
                          f"a prunus output, so choose a new or empty {flag}")
