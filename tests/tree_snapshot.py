"""A snapshot of a directory tree, to prove that a failed or refused command left it byte-for-byte intact."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root``: a file's sha256, a link's target, "special" for FIFOs and the like."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            rel = str(p.relative_to(root))
            if p.is_symlink():
                found[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                found[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            elif not p.is_dir():
                found[rel] = "special"
    return found
