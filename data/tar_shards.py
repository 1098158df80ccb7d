"""Image samples in tar shards (the WebDataset layout): ``DIR/shard-000000.tar`` holding ``KEY.png`` (or
``.jpg``, ``.jpeg``, ``.ppm``, ``.pgm``, ``.npy``) and ``KEY.cls`` (the class index as text) per sample;
``DIR/val-000000.tar`` ... the held-out samples, and ``classes.json`` the class names, when
:mod:`.write_shards` wrote them.

A shard is read with the standard ``tarfile`` module, uncompressed, and never extracted to disk: the scan
reads the headers alone (plus the few bytes of each ``.cls``) and refuses, in one line naming the shard and
the member, anything but regular files with plain relative names (no absolute names, no ``..``, no links or
devices), members above the size an image may hold, more than ``MAX_MEMBERS``, a sample without its image or
its class, or a class outside ``0 .. classes - 1``. Each sample is then an offset and a length in its shard,
read and decoded (Pillow, or ``numpy.load(allow_pickle=False)``) when it is used. The scanned index serves
both the shuffled stream of :mod:`.shard_stream` and random access (checks, the held-out split).
"""

from __future__ import annotations

import io
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import torch
from torch.utils.data import Dataset

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import read_json_object, short

from .image_folder import MAX_FILE_BYTES, MAX_PIXELS, NPY_SUFFIX, PIL_SUFFIXES, has_pil

TRAIN_PATTERN, VAL_PATTERN, CLASSES_FILE = "shard-*.tar", "val-*.tar", "classes.json"
IMAGE_SUFFIXES = (*PIL_SUFFIXES, NPY_SUFFIX)
MAX_MEMBERS, MAX_SHARDS, MAX_CLS_BYTES, MAX_NAME = 10_000_000, 100_000, 20, 1024


@dataclass(frozen=True)
class TarSample:
    """One sample of a shard: where its image bytes are, and its class."""

    shard: Path
    key: str
    suffix: str
    offset: int
    size: int
    label: int


def _member_name(shard: Path, member: tarfile.TarInfo) -> tuple[str, str]:
    """(key, suffix) of a member: a regular file with a plain relative name, or one line."""
    name = member.name
    parts = PurePosixPath(name).parts
    if (not name or len(name) > MAX_NAME or name.startswith("/") or "\\" in name or "\0" in name
            or any(p in ("..", ".") for p in parts)):
        raise PrunusError(f"{shard}: member {short(name)} is not a plain relative name; write the shard again "
                          "(prunus.data.write_shards)")
    if not member.isreg():
        kind = "link" if member.issym() or member.islnk() else "dir or device"
        raise PrunusError(f"{shard}: member {short(name)} is a {kind}, not a regular file; a shard holds KEY.<image> "
                          "and KEY.cls files only")
    base = parts[-1]
    stem, dot, suffix = base.partition(".")
    if not dot or not stem:
        raise PrunusError(f"{shard}: member {short(name)} has no KEY.extension name; name samples KEY.png and KEY.cls")
    return "/".join((*parts[:-1], stem)), "." + suffix.lower()


def _read_cls(tar: tarfile.TarFile, shard: Path, member: tarfile.TarInfo, classes: int | None) -> int:
    if member.size > MAX_CLS_BYTES:
        raise PrunusError(f"{shard}: {short(member.name)} holds {member.size:,} bytes; a .cls holds a class index")
    text = tar.extractfile(member).read(MAX_CLS_BYTES).decode("ascii", "replace").strip()
    if not text.isdigit() or (classes is not None and int(text) >= classes):
        raise PrunusError(f"{shard}: {short(member.name)} holds {short(text)}, not a class index from 0 to "
                          f"{'N - 1' if classes is None else classes - 1}")
    return int(text)


def _check_shard_file(shard: Path) -> None:
    try:
        mode = shard.lstat().st_mode
    except OSError as e:
        raise PrunusError(f"{shard}: cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise PrunusError(f"{shard}: not a regular file (a link, FIFO or device); put the shard files themselves there")


def scan_shard(shard: Path, classes: int | None = None) -> list[TarSample]:
    """The samples of one shard in member order, every header checked (see the module docstring)."""
    _check_shard_file(shard)
    images: dict[str, tuple[str, int, int]] = {}
    labels: dict[str, int] = {}
    try:
        with tarfile.open(shard, mode="r:") as tar:
            for count, member in enumerate(tar, 1):
                if count > MAX_MEMBERS:
                    raise PrunusError(f"{shard}: more than {MAX_MEMBERS:,} members; write smaller shards")
                key, suffix = _member_name(shard, member)
                if suffix == ".cls":
                    labels[key] = _read_cls(tar, shard, member, classes)
                elif suffix in IMAGE_SUFFIXES:
                    if member.size > MAX_FILE_BYTES:
                        raise PrunusError(f"{shard}: {short(member.name)} holds {member.size:,} bytes, above the "
                                          f"{MAX_FILE_BYTES:,} an image may hold")
                    if key in images:
                        raise PrunusError(f"{shard}: sample {short(key)} has two images; give each sample one")
                    images[key] = (suffix, member.offset_data, member.size)
    except (tarfile.TarError, EOFError, OSError, UnicodeError) as e:
        raise PrunusError(f"{shard}: not a readable uncompressed tar ({type(e).__name__}: {short(str(e), 80)}); "
                          "write it again") from None
    for key in images.keys() ^ labels.keys():
        raise PrunusError(f"{shard}: sample {short(key)} has {'no .cls' if key in images else 'no image'}; "
                          "a sample is KEY.<image> with KEY.cls")
    return [TarSample(shard, k, s, off, size, labels[k]) for k, (s, off, size) in images.items()]


def decode_sample(sample: TarSample) -> torch.Tensor:
    """The sample's image as float32 C x H x W (8-bit values scaled to [0, 1]), read from its shard."""
    with open(sample.shard, "rb") as f:
        f.seek(sample.offset)
        data = f.read(sample.size)
    where = f"{sample.shard}: {sample.key}{sample.suffix}"
    if len(data) != sample.size:
        raise PrunusError(f"{where}: the shard ends inside the image; write the shard again")
    try:
        if sample.suffix == NPY_SUFFIX:
            array = np.load(io.BytesIO(data), allow_pickle=False)
            if array.dtype.kind not in "biuf" or array.ndim not in (2, 3) or array.size > MAX_PIXELS * 4:
                raise ValueError(f"a {array.dtype} array of shape {array.shape}")
            array = array[None] if array.ndim == 2 else array
        else:
            array = _pil_array(data)
    except PrunusError:
        raise
    except Exception as e:  # noqa: BLE001 - any damage to the image: one line
        raise PrunusError(f"{where}: cannot be decoded ({type(e).__name__}: {short(str(e), 80)}); write it again") from None
    scale = 255.0 if array.dtype == np.uint8 else 1.0
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)) / scale


def _pil_array(data: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        if im.width * im.height > MAX_PIXELS:
            raise ValueError(f"{im.width} x {im.height} pixels, above {MAX_PIXELS:,}")
        im = im if im.mode in ("L", "RGB") else im.convert("L" if im.mode in ("1", "I;16", "I", "F") else "RGB")
        array = np.asarray(im)
    return array[None] if array.ndim == 2 else array.transpose(2, 0, 1)


def list_shards(root: Path, pattern: str) -> list[Path]:
    shards = sorted(root.glob(pattern))
    if len(shards) > MAX_SHARDS:
        raise PrunusError(f"--data {root}: {len(shards):,} shards, above {MAX_SHARDS:,}; write larger shards")
    return shards


def read_classes(root: Path) -> list[str] | None:
    """The class names of ``classes.json`` (a list of strings), or None without one."""
    path = root / CLASSES_FILE
    if not path.exists():
        return None
    names = read_json_object(path, fix="write it as {\"classes\": [names]}").get("classes")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise PrunusError(f"{path}: 'classes' must be a non-empty list of names")
    return names


def scan_shards(shards: list[Path], classes: int | None) -> list[TarSample]:
    samples = [s for shard in shards for s in scan_shard(shard, classes)]
    if not samples:
        raise PrunusError(f"--data {shards[0].parent}: the shards hold no samples")
    return samples


class TarSampleDataset(Dataset):
    """Random access to scanned samples: (image, class index); every image of the shape of the first."""

    def __init__(self, samples: list[TarSample], classes: list[str] | None):
        if not has_pil() and any(s.suffix != NPY_SUFFIX for s in samples[:1]):
            raise PrunusError(f"{samples[0].shard}: Pillow is not installed, so only .npy images are read; pip "
                              "install pillow")
        self.samples, self.classes = samples, classes
        self.shape = tuple(decode_sample(samples[0]).shape)

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, sample: TarSample):
        image = decode_sample(sample)
        if tuple(image.shape) != self.shape:
            raise PrunusError(f"{sample.shard}: {sample.key}{sample.suffix} decodes to {tuple(image.shape)}, not "
                              f"{self.shape} as the first sample; resize the images to one size")
        return image, torch.tensor(sample.label)

    def __getitem__(self, i: int):
        return self.load(self.samples[i])
