"""A directory of images in ImageFolder layout: ``ROOT/<class>/<image>``, classes in sorted name order.

Images are PNG, JPEG or PPM / PGM files, decoded with Pillow when it is installed, or ``.npy`` arrays (read
without pickles: ``H x W`` or ``C x H x W``, numbers only). Without Pillow only ``.npy`` files are read, and a
folder holding other images says so in one line. Every file is checked before training starts, from its header
alone (a regular file inside the root, its size, its shape: every image the same, within the cap on a decoded
sample); pixels are decoded when a sample is read, as float32 ``C x H x W`` (:mod:`.image_decode`: 8-bit
values scaled to [0, 1], 16-bit grey too, NaN and infinity refused). Hidden files and files of other types
are skipped; a class folder whose name is not UTF-8 is refused (class names are recorded as text).

The held-out split is chosen by a hash of each file's path under the root (about ``val_fraction`` of
them, at least one), the same on every machine and in every process.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import torch
from torch.utils.data import Dataset

from prunus.artifacts.errors import PrunusError

from .image_decode import NPY_SUFFIX, PIL_SUFFIXES, decode_bytes, header_shape, sample_limit, shown

MAX_FILE_BYTES = 64 << 20
MAX_CLASSES, MAX_FILES = 100_000, 10_000_000


def has_pil() -> bool:
    try:
        import PIL.Image  # noqa: F401
    except ImportError:
        return False
    return True


def _regular(path: Path) -> int:
    """Size of ``path``, a regular file (never opened otherwise); one line for anything else."""
    try:
        st = path.lstat()
    except OSError as e:
        raise PrunusError(f"{shown(path)}: cannot be read ({e.strerror}); fix the image folder") from None
    if not stat.S_ISREG(st.st_mode):
        raise PrunusError(f"{shown(path)}: not a regular file (a link, FIFO or device); put image files in the class "
                          "folders")
    if st.st_size > MAX_FILE_BYTES:
        raise PrunusError(f"{shown(path)}: {st.st_size:,} bytes, above the {MAX_FILE_BYTES:,} an image may hold")
    return st.st_size


def sample_shape(path: Path, limit: int | None = None) -> tuple[int, ...]:
    """C x H x W of one image, from its header (``limit``: the cap on its decoded bytes, :func:`.sample_limit`)."""
    size = _regular(path)
    if path.suffix.lower() != NPY_SUFFIX and not has_pil():
        raise PrunusError(f"{shown(path)}: Pillow is not installed, so only .npy images are read; pip install pillow, "
                          "or store the images as .npy arrays")
    return header_shape(path, shown(path), size, sample_limit(limit) if limit is None else limit)


def decode(path: Path, limit: int | None = None) -> torch.Tensor:
    """The image at ``path`` as float32 C x H x W (see :mod:`.image_decode`)."""
    _regular(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise PrunusError(f"{shown(path)}: cannot be read ({e.strerror}); fix the image folder") from None
    if len(data) > MAX_FILE_BYTES:
        raise PrunusError(f"{shown(path)}: grew above the {MAX_FILE_BYTES:,} bytes an image may hold")
    return decode_bytes(data, path.suffix, shown(path), sample_limit(limit) if limit is None else limit)


class ImageFolderDataset(Dataset):
    """(image, class index) pairs of the files given (all checked: :func:`image_folder_datasets`); ``limit``:
    the cap on a decoded sample's bytes."""

    finite_checked = True  # every float sample is checked at decode (image_decode.check_finite)

    def __init__(self, files: list[tuple[Path, int]], classes: list[str], shape: tuple[int, ...],
                 limit: int | None = None):
        self.files, self.classes, self.shape = files, classes, shape
        self.limit = sample_limit() if limit is None else limit

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        path, label = self.files[i]
        image = decode(path, self.limit)
        if tuple(image.shape) != self.shape:
            raise PrunusError(f"{shown(path)}: decodes to {tuple(image.shape)}, not {self.shape} as its header said")
        return image, torch.tensor(label)


def _class_names(root: Path) -> list[str]:
    names = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.is_symlink() and not d.name.startswith("."))
    for name in names:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise PrunusError(f"--data {shown(root)}: the class folder {os.fsencode(name)!r} has a name that is not "
                              "UTF-8; rename it (class names are recorded as text)") from None
    return names


def _list_images(root: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    classes = _class_names(root)
    if not classes:
        raise PrunusError(f"--data {shown(root)}: no class folders; put each class's images in ROOT/<class>/ "
                          "(ImageFolder layout)")
    if len(classes) > MAX_CLASSES:
        raise PrunusError(f"--data {shown(root)}: {len(classes):,} class folders, above {MAX_CLASSES:,}")
    suffixes = (*PIL_SUFFIXES, NPY_SUFFIX)
    files = []
    for label, name in enumerate(classes):
        for entry in sorted(os.scandir(root / name), key=lambda e: e.name):
            if not entry.name.startswith(".") and entry.name.lower().endswith(suffixes):
                files.append((root / name / entry.name, label))
            if len(files) > MAX_FILES:
                raise PrunusError(f"--data {shown(root)}: more than {MAX_FILES:,} images")
    if not files:
        raise PrunusError(f"--data {shown(root)}: no images (.png, .jpg, .ppm, .pgm, .npy) in its class folders")
    return classes, files


def _held_out(root: Path, path: Path, fraction: float) -> bool:
    digest = hashlib.sha256(os.fsencode(path.relative_to(root).as_posix())).digest()  # any file name's bytes
    return int.from_bytes(digest[:4], "big") < fraction * 2**32


def image_folder_datasets(root: str | Path, val_fraction: float = 0.1, *, max_sample_bytes: int | None = None
                          ) -> tuple[ImageFolderDataset, ImageFolderDataset]:
    """(train, held-out) of the image folder at ``root``, every file checked from its header; ``max_sample_bytes``:
    the cap on one decoded sample (default ``PRUNUS_MAX_SAMPLE_MB``, 64 MiB)."""
    root, limit = Path(root), sample_limit(max_sample_bytes)
    classes, files = _list_images(root)
    shape = sample_shape(files[0][0], limit)
    for path, _ in files[1:]:
        other = sample_shape(path, limit)
        if other != shape:
            raise PrunusError(f"{shown(path)}: an image of {other} (C x H x W) among images of {shape}; resize the "
                              "images to one size")
    val = [f for f in files if _held_out(root, f[0], val_fraction)] or [files[-1]]
    held = {path for path, _ in val}
    train = [f for f in files if f[0] not in held] if len(files) > len(val) else files
    return ImageFolderDataset(train, classes, shape, limit), ImageFolderDataset(val, classes, shape, limit)
