"""Names read from inside an artifact resolve inside it: the one containment check of every reader.

A Hugging Face index maps tensors to shard files, a manifest lists the files it vouches for, an
export's config.json names its graphs, a checkpoint's ``train_state.json`` its files. Each such
name is joined to its dir only through :func:`inside`, which refuses, in one PrunusError line
naming the entry:

* a name that is not a plain relative file name (not a string, empty, absolute, holding ``..``,
  a backslash or a NUL);
* a name whose ``resolve()`` (symlinks followed) lies outside the dir. One layout is allowed to
  point elsewhere: a Hugging Face hub cache snapshot (``<repo>/snapshots/<rev>/...``), whose files
  are symlinks into the same repo's ``blobs/`` folder;
* anything but a regular file where a file is expected (a FIFO, which would block the open, a
  directory, a device, a socket, a broken symlink);
* a missing file, unless the caller says the file is optional (then ``None``).

The fixed names of a format (``config.json``, ``tokenizer.json``, ...) go through it too, so a
hostile dir cannot smuggle another file in through a symlink or hang a reader with a FIFO.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from .errors import PrunusError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _show(value, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (as prunus.artifacts.validate.short, which imports this module)."""
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def plain_name(name) -> bool:
    """True for a relative POSIX file name without ``..``, ``.``, empty parts, backslashes or NULs."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        return False
    p = PurePosixPath(name)
    return not p.is_absolute() and all(part not in ("", ".", "..") for part in name.split("/"))


def _roots(root: Path) -> tuple[Path, ...]:
    """``root`` and, for a dir inside a hub cache snapshot (``<repo>/snapshots/<rev>/...``), ``<repo>/blobs``."""
    for p in (root, *root.parents):
        if p.parent.name == "snapshots" and (p.parent.parent / "blobs").is_dir():
            return root, p.parent.parent / "blobs"
    return (root,)


def _kind(mode: int) -> str | None:
    """None for a regular file, else what the mode says it is."""
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "something else")


def inside(directory: str | Path, name, source: str | None = None, *, fix: str = "re-create the dir",
           required: bool = True) -> Path | None:
    """``directory / name`` when it is a regular file inside ``directory``; else one PrunusError line
    "{source} names {name}, which ...; {fix}" (``source``: the file and entry the name came from; None
    for a format's fixed name, then the line starts with the path itself). A missing file is an error
    when ``required``, else None."""
    directory = Path(directory)
    where = f"{source} names {_show(name)}, which" if source else f"{directory / str(name)}:"
    if not plain_name(name):
        why = ("is not a file name" if not isinstance(name, str) or not name else
               "is an absolute path" if name.startswith("/") else
               "is not a plain name inside the dir (it holds '..', a backslash or a NUL)")
        raise PrunusError(f"{where} {why}; only files inside {directory} are read, {fix}")
    path = directory / name
    try:
        root = directory.resolve()
        target = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop
        raise PrunusError(f"{where} is a symlink loop; {fix}") from None
    if not any(target.is_relative_to(r) for r in _roots(root)):
        raise PrunusError(f"{where} leads outside {directory} (a symlink to {_show(str(target))}); "
                          f"only files inside the dir are read, {fix}")
    try:
        mode = os.stat(path).st_mode  # never open before this: opening a FIFO blocks
    except FileNotFoundError:
        if os.path.lexists(path):
            raise PrunusError(f"{where} is a broken symlink; {fix}") from None
        if not required:
            return None
        raise PrunusError(f"{where} is missing from {directory}; {fix}") from None
    except OSError as e:
        raise PrunusError(f"{where} cannot be read ({e.strerror or e}); {fix}") from None
    kind = _kind(mode)
    if kind is not None:
        raise PrunusError(f"{where} is {kind}, not a regular file; {fix}")
    return path
