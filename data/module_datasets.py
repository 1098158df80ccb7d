"""``--data`` of a generic module's training run: (train, held-out) datasets of (input, target) samples.

* ``synthetic:classification?n=256&shape=3x32x32&classes=10`` (or ``synthetic:regression?...``):
  :mod:`.synthetic`, for tests and benchmarks;
* a directory in ImageFolder layout (``ROOT/<class>/<image>``): :mod:`.image_folder`.

Data that may hold code (``.pt`` files, pickles) is never read.
"""

from __future__ import annotations

from pathlib import Path

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short

from .image_folder import image_folder_datasets
from .synthetic import PREFIX, synthetic_datasets

EXAMPLE = "synthetic:classification?n=256&shape=3x32x32&classes=10"


def module_datasets(spec: str, val_fraction: float = 0.1):
    """(train, held-out) datasets that ``spec`` names; one line for anything else."""
    if not isinstance(spec, str) or not spec:
        raise PrunusError(f"--data {short(spec)}: give an ImageFolder directory or {EXAMPLE}")
    if spec.startswith(PREFIX):
        return synthetic_datasets(spec)
    path = Path(spec)
    if path.is_dir():
        return image_folder_datasets(path, val_fraction)
    what = "does not exist" if not path.exists() else "is a file, not an ImageFolder directory"
    raise PrunusError(f"--data {short(spec)}: {what}; give a directory of class folders of images, or {EXAMPLE}")
