"""A directory of images in ImageFolder layout: ``ROOT/<class>/<image>``, classes in sorted name order.

Images are PNG, JPEG or PPM / PGM files, decoded with Pillow when it is installed, or ``.npy`` arrays (read
with ``allow_pickle=False``: ``H x W`` or ``C x H x W``, numbers only). Without Pillow only ``.npy`` files are
read, and a folder holding other images says so in one line. Every file is checked before training starts,
from its header alone (a regular file inside the root, its size, its pixel count, its shape: every image the
same); pixels are decoded when a sample is read, as float32 ``C x H x W`` (8-bit values scaled to [0, 1]).
Hidden files and files of other types are skipped.

The held-out split is chosen by a hash of each file's path under the root (about ``val_fraction`` of
them, at least one), the same on every machine and in every process.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short

PIL_SUFFIXES = (".png", ".jpg", ".jpeg", ".ppm", ".pgm")
NPY_SUFFIX = ".npy"
MAX_FILE_BYTES = 64 << 20
MAX_PIXELS = 2**26
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
        raise PrunusError(f"{path}: cannot be read ({e.strerror}); fix the image folder") from None
    if not stat.S_ISREG(st.st_mode):
        raise PrunusError(f"{path}: not a regular file (a link, FIFO or device); put image files in the class folders")
    if st.st_size > MAX_FILE_BYTES:
        raise PrunusError(f"{path}: {st.st_size:,} bytes, above the {MAX_FILE_BYTES:,} an image may hold")
    return st.st_size


def _npy_header(path: Path) -> tuple[tuple[int, ...], np.dtype]:
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f, max_header_size=10_000)
    except Exception as e:  # noqa: BLE001 - any damage to the header: one line
        raise PrunusError(f"{path}: not a .npy array ({short(str(e), 80)}); save it with numpy.save") from None
    if dtype.hasobject or dtype.kind not in "biuf" or fortran:
        raise PrunusError(f"{path}: holds {dtype} ({'Fortran order' if fortran else 'not numbers'}); store a C-order "
                          "array of numbers")
    if len(shape) not in (2, 3) or math.prod(shape) > MAX_PIXELS * 4:
        raise PrunusError(f"{path}: shape {shape}; an image array is H x W or C x H x W of at most {MAX_PIXELS:,} pixels")
    return (1, *shape) if len(shape) == 2 else tuple(shape), dtype


def _pil_shape(path: Path) -> tuple[int, ...]:
    from PIL import Image

    try:
        with Image.open(path) as im:
            w, h, mode = im.width, im.height, im.mode
    except Exception as e:  # noqa: BLE001 - Pillow's errors on a damaged file: one line
        raise PrunusError(f"{path}: not an image Pillow reads ({type(e).__name__}); remove or replace it") from None
    if w * h > MAX_PIXELS:
        raise PrunusError(f"{path}: {w} x {h} pixels, above the {MAX_PIXELS:,} an image may hold")
    return (1 if mode in ("L", "1", "I;16", "I", "F") else 3, h, w)


def sample_shape(path: Path) -> tuple[int, ...]:
    """C x H x W of one image, from its header."""
    _regular(path)
    if path.suffix.lower() == NPY_SUFFIX:
        return _npy_header(path)[0]
    if not has_pil():
        raise PrunusError(f"{path}: Pillow is not installed, so only .npy images are read; pip install pillow, or "
                          "store the images as .npy arrays")
    return _pil_shape(path)


def decode(path: Path) -> torch.Tensor:
    """The image at ``path`` as float32 C x H x W (8-bit values scaled to [0, 1])."""
    try:
        if path.suffix.lower() == NPY_SUFFIX:
            array = np.load(path, allow_pickle=False)
            array = array[None] if array.ndim == 2 else array
        else:
            from PIL import Image

            with Image.open(path) as im:
                im = im if im.mode in ("L", "RGB") else im.convert("L" if _pil_shape(path)[0] == 1 else "RGB")
                array = np.asarray(im)
            array = array[None] if array.ndim == 2 else array.transpose(2, 0, 1)
    except PrunusError:
        raise
    except Exception as e:  # noqa: BLE001 - pixels damaged past the header
        raise PrunusError(f"{path}: cannot be decoded ({type(e).__name__}: {short(str(e), 80)}); remove or replace it") from None
    scale = 255.0 if array.dtype == np.uint8 else 1.0
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)) / scale


class ImageFolderDataset(Dataset):
    """(image, class index) pairs of the files given (all checked: :func:`image_folder_datasets`)."""

    def __init__(self, files: list[tuple[Path, int]], classes: list[str], shape: tuple[int, ...]):
        self.files, self.classes, self.shape = files, classes, shape

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        path, label = self.files[i]
        image = decode(path)
        if tuple(image.shape) != self.shape:
            raise PrunusError(f"{path}: decodes to {tuple(image.shape)}, not {self.shape} as its header said")
        return image, torch.tensor(label)


def _list_images(root: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.is_symlink() and not d.name.startswith("."))
    if not classes:
        raise PrunusError(f"--data {root}: no class folders; put each class's images in ROOT/<class>/ (ImageFolder layout)")
    if len(classes) > MAX_CLASSES:
        raise PrunusError(f"--data {root}: {len(classes):,} class folders, above {MAX_CLASSES:,}")
    suffixes = (*PIL_SUFFIXES, NPY_SUFFIX)
    files = []
    for label, name in enumerate(classes):
        for entry in sorted(os.scandir(root / name), key=lambda e: e.name):
            if not entry.name.startswith(".") and entry.name.lower().endswith(suffixes):
                files.append((root / name / entry.name, label))
            if len(files) > MAX_FILES:
                raise PrunusError(f"--data {root}: more than {MAX_FILES:,} images")
    if not files:
        raise PrunusError(f"--data {root}: no images (.png, .jpg, .ppm, .pgm, .npy) in its class folders")
    return classes, files


def _held_out(root: Path, path: Path, fraction: float) -> bool:
    digest = hashlib.sha256(path.relative_to(root).as_posix().encode()).digest()
    return int.from_bytes(digest[:4], "big") < fraction * 2**32


def image_folder_datasets(root: str | Path, val_fraction: float = 0.1) -> tuple[ImageFolderDataset, ImageFolderDataset]:
    """(train, held-out) of the image folder at ``root``, every file checked from its header."""
    root = Path(root)
    classes, files = _list_images(root)
    shape = sample_shape(files[0][0])
    for path, _ in files[1:]:
        other = sample_shape(path)
        if other != shape:
            raise PrunusError(f"{path}: an image of {other} (C x H x W) among images of {shape}; resize the images to "
                              "one size")
    val = [f for f in files if _held_out(root, f[0], val_fraction)] or [files[-1]]
    held = {path for path, _ in val}
    train = [f for f in files if f[0] not in held] if len(files) > len(val) else files
    return ImageFolderDataset(train, classes, shape), ImageFolderDataset(val, classes, shape)
