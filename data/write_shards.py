"""Write an image folder as tar shards (:mod:`.tar_shards`): ``write_shards(FOLDER, OUT)``, or

    python -m prunus.data.write_shards FOLDER OUT [--per-shard 1000] [--val-fraction 0.1]

Every image is checked as the image folder reader checks it, then stored with its original bytes as
``KEY<suffix>`` beside ``KEY.cls`` (the class index), ``per_shard`` samples a shard, in ``shard-NNNNNN.tar``
(training) and ``val-NNNNNN.tar`` (the held-out split the image folder reader would choose); the class
names go to ``classes.json``. Keys are ``<class index>_<file stem>`` with anything but letters, digits, ``-``
and ``_`` replaced. The output dir is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import io
import re
import shutil
import sys
import tarfile
from pathlib import Path

from prunus.artifacts.atomic import atomic_write_json
from prunus.artifacts.errors import PrunusError

from .image_folder import image_folder_datasets
from .tar_shards import CLASSES_FILE


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))


def _write(files, prefix: str, out: Path, per_shard: int) -> int:
    shards = 0
    for start in range(0, len(files), per_shard):
        with tarfile.open(out / f"{prefix}-{shards:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for path, label in files[start:start + per_shard]:
                key = f"{label}_{re.sub(r'[^A-Za-z0-9_-]', '_', path.stem)}"
                _add(tar, key + path.suffix.lower(), path.read_bytes())
                _add(tar, key + ".cls", str(label).encode())
        shards += 1
    return shards


def write_shards(folder: str | Path, out: str | Path, *, per_shard: int = 1000, val_fraction: float = 0.1,
                 overwrite: bool = False) -> dict:
    """Write the image folder ``folder`` as shards in ``out``; returns {"train": shards, "val": shards, "samples"}."""
    out = Path(out)
    if per_shard < 1:
        raise PrunusError(f"--per-shard {per_shard} must be at least 1")
    if out.exists() and not overwrite:
        raise PrunusError(f"{out}: already exists; choose another output dir or pass overwrite")
    train, val = image_folder_datasets(folder, val_fraction)  # every file checked before anything is written
    keys = {(label, re.sub(r"[^A-Za-z0-9_-]", "_", p.stem)) for p, label in train.files + val.files}
    if len(keys) < len(train.files) + len(val.files):
        raise PrunusError(f"{folder}: two images of one class map to the same key; give the files distinct stems")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        counts = {"train": _write(train.files, "shard", tmp, per_shard),
                  "val": _write(val.files, "val", tmp, per_shard) if val.files != train.files else 0,
                  "samples": len(train) + len(val)}
        atomic_write_json(tmp / CLASSES_FILE, {"classes": train.classes})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prunus.data.write_shards", description=__doc__.split("\n")[0])
    parser.add_argument("folder")
    parser.add_argument("out")
    parser.add_argument("--per-shard", type=int, default=1000)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        counts = write_shards(args.folder, args.out, per_shard=args.per_shard, val_fraction=args.val_fraction,
                              overwrite=args.overwrite)
    except PrunusError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {counts['train']} training and {counts['val']} held-out shards, {counts['samples']} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
