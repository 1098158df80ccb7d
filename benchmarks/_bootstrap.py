"""Lets a benchmark run as a file (``python benchmarks/NAME.py``) as well as a module (``python -m benchmarks.NAME``).

Run as a file, Python puts ``benchmarks/`` on the import path, not the repository root, so ``benchmarks.harness``
would not import. Each benchmark starts with::

    if not __package__:  # run as a file, not with -m
        import _bootstrap  # noqa: F401

and this puts the root first on the import path, once, the only place that touches it.
"""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
