"""``prunus.json``, the manifest of a model dir or an export dir: its shape, and the files it vouches for.

:func:`check_manifest` is the one validator of the format: ``files`` maps plain file names inside
the dir to SHA-256 hex digests (a name that is absolute, holds ``..`` or leads out of the dir
through a symlink is refused, never read or hashed), and the other keys have the types readers
rely on. :func:`verify_files` then checks every listed file against its hash; it serves model
dirs and export dirs alike.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from .contained import inside, plain_name
from .errors import PrunusError
from .validate import short

MANIFEST = "prunus.json"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# key -> (accepted types, what it must be); keys a manifest may leave out
_FIELDS = {"format": (str, "a string"), "stage": (str, "a string"), "command": (str, "a string"),
           "created": (str, "a string"), "parent": ((dict, type(None)), "an object or null"),
           "metrics": (dict, "an object"), "versions": (dict, "an object")}


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def check_manifest(manifest: dict, path: str | Path, fix: str = "re-create the dir") -> dict:
    """Raise one PrunusError line when ``manifest`` (read from ``path/prunus.json``) is malformed."""
    where = Path(path) / MANIFEST
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise PrunusError(f"{where}: 'files' must be an object of file name -> SHA-256; {fix}")
    for name, digest in files.items():
        if not plain_name(name):
            raise PrunusError(f"{where}: lists {short(name)}, which is not a file name inside the dir; {fix}")
        if not isinstance(digest, str) or not _HEX64.match(digest):
            raise PrunusError(f"{where}: the hash of {short(name)} is {short(digest)}, not a SHA-256 hex digest; {fix}")
    for key, (types, what) in _FIELDS.items():
        if key in manifest and not isinstance(manifest[key], types):
            raise PrunusError(f"{where}: '{key}' is {short(manifest[key])}, not {what}; {fix}")
    parent = manifest.get("parent")
    if parent is not None and not (isinstance(parent.get("path"), str) and isinstance(parent.get("hash"), str)):
        raise PrunusError(f"{where}: 'parent' needs a string 'path' and 'hash'; {fix}")
    return manifest


def verify_files(path: str | Path, manifest: dict, required: tuple[str, ...] = (), kind: str = "model dir") -> dict:
    """Every file ``manifest`` lists is a regular file inside ``path`` with the listed hash; ``required``
    files are listed. Returns the manifest."""
    path = Path(path)
    fix = f"re-create the {kind}"
    check_manifest(manifest, path, fix)
    for name in required:
        if name not in manifest["files"]:
            raise PrunusError(f"{path / MANIFEST}: does not list {name}; {fix}")
    for name, digest in manifest["files"].items():
        # inside the dir through symlinks, a regular file (never a FIFO that blocks the hash)
        f = inside(path, name, f"{path / MANIFEST}: files", fix=fix, required=False)
        if f is None:
            raise PrunusError(f"{path / name}: missing from the {kind}; restore it or {fix}")
        if sha256_file(f) != digest:
            raise PrunusError(f"{f}: content hash does not match {MANIFEST}; the file was changed or corrupted, {fix}")
    return manifest
