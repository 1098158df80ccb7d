"""One image sample, decoded within bounds: a PNG, JPEG or PPM / PGM / PFM (Pillow) or a ``.npy`` array, from
a file or from bytes (a tar shard's member), as float32 ``C x H x W``.

The header is read first, alone (Pillow's ``Image.open`` is lazy; ``.npy`` through numpy's header reader),
and the float32 tensor it would become must fit the cap on one sample before a pixel is decoded:
``PRUNUS_MAX_SAMPLE_MB`` MiB (default 64, far above any image a model trains on), or the Python API's
``max_sample_bytes``. A ``.npy`` header must also account for exactly the bytes that follow it. Pillow's
own decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``) stays in force, its warning taken as a
refusal, and only the PNG, JPEG and PPM readers are used, whatever the file holds.

Values: 8-bit samples are scaled to [0, 1] by 255, 16-bit grey (PNG, PGM) by 65535. 16-bit colour, which
Pillow reads as 8 bits, is refused rather than cut. PFM floats and ``.npy`` numbers are taken as they are
(a uint8 array scaled by 255). A float sample holding NaN or infinity is refused. Whatever is wrong with a
sample is one line naming it.
"""

from __future__ import annotations

import io
import math
import os
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short

from .finite import check_finite

PIL_SUFFIXES = (".png", ".jpg", ".jpeg", ".ppm", ".pgm")
NPY_SUFFIX = ".npy"
PIL_FORMATS = ("PNG", "JPEG", "PPM")  # the readers Pillow may use (PPM covers PGM and PFM)
LIMIT_ENV, DEFAULT_LIMIT_MB, MAX_LIMIT_MB = "PRUNUS_MAX_SAMPLE_MB", 64, 1 << 20
GREY16 = ("I;16", "I;16B", "I;16L", "I;16N", "I")  # Pillow's modes of 16-bit grey (PNG, PGM)
_OPEN_LOCK = threading.Lock()  # warnings filters are process-wide: one header read at a time changes them


def _fresh_lock() -> None:  # a DataLoader worker forked while another thread held the lock starts with it free
    global _OPEN_LOCK
    _OPEN_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock)


def shown(path) -> str:
    """``path`` as text that prints anywhere (bytes of a name that is not UTF-8 as ``\\xNN``)."""
    return os.fsencode(str(path)).decode("utf-8", "backslashreplace")


def sample_limit(max_sample_bytes: int | None = None) -> int:
    """The cap on one decoded sample in bytes: ``max_sample_bytes``, else ``PRUNUS_MAX_SAMPLE_MB`` MiB (64)."""
    if max_sample_bytes is not None:
        if isinstance(max_sample_bytes, bool) or not isinstance(max_sample_bytes, int) or max_sample_bytes < 1:
            raise PrunusError(f"max_sample_bytes={short(max_sample_bytes)}: give a positive number of bytes")
        return max_sample_bytes
    text = os.environ.get(LIMIT_ENV, "").strip()
    if not text:
        return DEFAULT_LIMIT_MB << 20
    if not text.isdigit() or not 1 <= int(text) <= MAX_LIMIT_MB:
        raise PrunusError(f"{LIMIT_ENV}={short(text)}: give a whole number of MiB from 1 to {MAX_LIMIT_MB:,} "
                          f"(default {DEFAULT_LIMIT_MB})")
    return int(text) << 20


def _check_size(shape: tuple[int, ...], where: str, limit: int) -> None:
    size = 4 * math.prod(shape)
    if size > limit:
        raise PrunusError(f"{where}: {' x '.join(map(str, shape))} (C x H x W) decodes to {size:,} bytes of float32, "
                          f"above the {limit:,} a sample may take; use smaller images, or raise {LIMIT_ENV} "
                          f"(now {limit / 2**20:g})")


# --- .npy ---------------------------------------------------------------------------------------------------------

def _npy_header(f, where: str, total: int, limit: int) -> tuple[tuple[int, ...], np.dtype, int]:
    """(C x H x W, dtype, data offset) of the .npy in ``f`` of ``total`` bytes, every size checked."""
    try:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f, max_header_size=10_000)
    except Exception as e:  # noqa: BLE001 - any damage to the header: one line
        raise PrunusError(f"{where}: not a .npy array ({short(str(e), 80)}); save it with numpy.save") from None
    if dtype.hasobject or dtype.kind not in "biuf" or fortran:
        raise PrunusError(f"{where}: holds {dtype} ({'Fortran order' if fortran else 'not numbers'}); store a "
                          "C-order array of numbers")
    if len(shape) not in (2, 3) or 0 in shape:
        raise PrunusError(f"{where}: shape {shape}; an image array is H x W or C x H x W")
    shape = (1, *shape) if len(shape) == 2 else tuple(shape)
    _check_size(shape, where, limit)
    offset, body = f.tell(), math.prod(shape) * dtype.itemsize
    if offset + body != total:
        raise PrunusError(f"{where}: its header says {shape} of {dtype} ({body:,} bytes), but {total - offset:,} "
                          "bytes follow it; save it again with numpy.save")
    return shape, dtype, offset


def _npy_array(data: bytes, where: str, limit: int) -> tuple[np.ndarray, float, bool]:
    shape, dtype, offset = _npy_header(io.BytesIO(data), where, len(data), limit)
    array = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)
    return array, 255.0 if dtype == np.uint8 else 1.0, dtype.kind == "f"


# --- Pillow -------------------------------------------------------------------------------------------------------

def _open(source, where: str):
    """The lazily opened image (its header read, no pixel decoded), or one line."""
    try:
        from PIL import Image
    except ImportError:
        raise PrunusError(f"{where}: Pillow is not installed, so only .npy images are read; pip install pillow, or "
                          "store the images as .npy arrays") from None

    try:
        with _OPEN_LOCK, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(source, formats=PIL_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise PrunusError(f"{where}: more pixels than Pillow's decompression-bomb limit (PIL.Image.MAX_IMAGE_PIXELS = "
                          f"{Image.MAX_IMAGE_PIXELS:,}); use smaller images") from None
    except Exception as e:  # noqa: BLE001 - Pillow's errors on a damaged or foreign file: one line
        raise PrunusError(f"{where}: not a PNG, JPEG or PPM / PGM image Pillow reads ({type(e).__name__}); remove or "
                          "replace it") from None


def _sixteen_bit(im) -> bool:
    """Whether the file stores 16-bit samples (PNG's ``;16`` raw modes, a PPM maxval above 255)."""
    for tile in im.tile[:1]:
        args = tile[3] if isinstance(tile[3], tuple) else (tile[3],)
        if any(isinstance(a, str) and ";16" in a for a in args):
            return True
        if len(args) > 1 and isinstance(args[1], int) and not isinstance(args[1], bool) and args[1] > 255:
            return True
    return False


def _plan(im, where: str, limit: int) -> tuple[tuple[int, int, int], str | None, float]:
    """(C x H x W, the mode to convert to or None, the scale) of an opened image, its size checked."""
    mode = im.mode
    if mode in GREY16:
        channels, convert, scale = 1, None, 65535.0
    elif mode == "F":
        channels, convert, scale = 1, None, 1.0
    elif _sixteen_bit(im):
        raise PrunusError(f"{where}: 16-bit {mode} samples, which Pillow reads as 8 bits; store them as float32 .npy "
                          "arrays (C x H x W, scaled to [0, 1]) to keep their precision, or as 8-bit images")
    elif mode in ("L", "1"):
        channels, convert, scale = 1, None if mode == "L" else "L", 255.0
    else:
        channels, convert, scale = 3, None if mode == "RGB" else "RGB", 255.0
    shape = (channels, im.height, im.width)
    _check_size(shape, where, limit)
    return shape, convert, scale


def _pil_array(data: bytes, where: str, limit: int) -> tuple[np.ndarray, float, bool]:
    with _open(io.BytesIO(data), where) as im:
        _, convert, scale = _plan(im, where, limit)
        mode = im.mode
        try:
            im.load()
            array = np.asarray(im.convert(convert) if convert else im)
        except Exception as e:  # noqa: BLE001 - pixels damaged past the header
            raise PrunusError(f"{where}: cannot be decoded ({type(e).__name__}: {short(str(e), 80)}); remove or "
                              "replace it") from None
    return (array[None] if array.ndim == 2 else array.transpose(2, 0, 1)), scale, mode == "F"


# --- either -------------------------------------------------------------------------------------------------------

def header_shape(path: Path, where: str, size: int, limit: int) -> tuple[int, int, int]:
    """C x H x W of the image file ``path`` (of ``size`` bytes) from its header alone, within the cap."""
    if path.suffix.lower() == NPY_SUFFIX:
        try:
            with open(path, "rb") as f:
                return _npy_header(f, where, size, limit)[0]
        except OSError as e:
            raise PrunusError(f"{where}: cannot be read ({e.strerror}); fix the image folder") from None
    with _open(path, where) as im:
        return _plan(im, where, limit)[0]


def decode_bytes(data: bytes, suffix: str, where: str, limit: int) -> torch.Tensor:
    """The image in ``data`` (a file of type ``suffix``) as float32 C x H x W, checked as the module docstring says."""
    array, scale, is_float = (_npy_array if suffix.lower() == NPY_SUFFIX else _pil_array)(data, where, limit)
    with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes infinite, refused below
        tensor = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))  # a copy: ``data`` stays read-only
    if scale != 1.0:
        tensor.div_(scale)
    if is_float:
        check_finite(tensor, where)
    return tensor
