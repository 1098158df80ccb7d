"""``--data`` of a generic module's training run: (train, held-out) datasets of (input, target) samples.

* ``synthetic:classification?n=256&shape=3x32x32&classes=10`` (or ``synthetic:regression?...``):
  :mod:`.synthetic`, for tests and benchmarks;
* a directory in ImageFolder layout (``ROOT/<class>/<image>``): :mod:`.image_folder`;
* a directory of tar shards (``shard-000000.tar`` ..., WebDataset layout, ``val-*.tar`` held out):
  :mod:`.tar_shards`, streamed by :mod:`.shard_stream`;
* a table or arrays (``table.csv?target=y&features=a,b``, ``.parquet``, ``.npy``, ``.npz``): :mod:`.tables`.

A separate test set (``--test-data``, any of these) is held out whole: :func:`train_test_datasets`.

Data that may hold code (``.pt`` files, pickles) is never read.
"""

from __future__ import annotations

from pathlib import Path

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short

from .image_decode import sample_limit
from .image_folder import image_folder_datasets
from .synthetic import PREFIX, synthetic_datasets
from .tar_shards import TRAIN_PATTERN, VAL_PATTERN, list_shards

EXAMPLE = "synthetic:classification?n=256&shape=3x32x32&classes=10"


def shard_datasets(root: Path, buffer: int = 256, limit: int | None = None):
    """(the training stream, the held-out samples) of a shard dir; without ``val-*.tar``, the held-out split is
    the training shards' first samples (said in one line when there are none)."""
    from .shard_stream import TarShardStream
    from .tar_shards import TarSampleDataset, read_classes, scan_shard

    classes = read_classes(root)
    n = len(classes) if classes else None
    train = TarShardStream([scan_shard(s, n) for s in list_shards(root, TRAIN_PATTERN)], classes, buffer=buffer,
                           limit=limit)
    val = [s for shard in list_shards(root, VAL_PATTERN) for s in scan_shard(shard, n)]
    return train, TarSampleDataset(val, classes, limit) if val else train.index


def module_datasets(spec: str, val_fraction: float = 0.1, shuffle_buffer: int = 256, *,
                    max_sample_bytes: int | None = None, task: str | None = None, classes: list | None = None):
    """(train, held-out) datasets that ``spec`` names; one line for anything else. ``max_sample_bytes``: the cap
    on one decoded image (default ``PRUNUS_MAX_SAMPLE_MB`` MiB, 64; :mod:`.image_decode`). A table's ``task``
    decides how its target is read and ``classes`` (a trained model's) how its labels map (:mod:`.tables`)."""
    from .tables import is_table_spec, table_datasets

    if not isinstance(spec, str) or not spec:
        raise PrunusError(f"--data {short(spec)}: give an ImageFolder directory or {EXAMPLE}")
    if spec.startswith(PREFIX):
        return synthetic_datasets(spec)
    if is_table_spec(spec) and not Path(spec).is_dir():
        return table_datasets(spec, val_fraction, task=task, classes=classes)
    path = Path(spec)
    if path.is_dir() and list_shards(path, TRAIN_PATTERN):
        return shard_datasets(path, buffer=shuffle_buffer, limit=sample_limit(max_sample_bytes))
    if path.is_dir():
        return image_folder_datasets(path, val_fraction, max_sample_bytes=max_sample_bytes)
    what = "does not exist" if not path.exists() else "is a file, not an ImageFolder directory"
    raise PrunusError(f"--data {short(spec)}: {what}; give a directory of class folders of images, a table "
                      f"(.csv, .parquet, .npy, .npz), or {EXAMPLE}")


def train_test_datasets(spec: str, test_spec: str | None, val_fraction: float = 0.1, shuffle_buffer: int = 256, *,
                        task: str | None = None):
    """(train, held-out): ``spec``'s split, or with ``test_spec`` all of ``spec`` (a table's; an image folder or
    synthetic data keep their own split) and the whole of ``test_spec`` held out, its labels mapped to the
    training data's classes."""
    if test_spec is None:
        return module_datasets(spec, val_fraction, shuffle_buffer, task=task)
    train, _ = module_datasets(spec, 0.0, shuffle_buffer, task=task)
    _, test = module_datasets(test_spec, 1.0, shuffle_buffer, task=task, classes=getattr(train, "classes", None))
    return train, test
