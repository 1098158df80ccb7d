"""Image samples in tar shards (the WebDataset layout): ``DIR/shard-000000.tar`` holding ``KEY.png`` (or
``.jpg``, ``.jpeg``, ``.ppm``, ``.pgm``, ``.npy``) and ``KEY.cls`` (the class index as text) per sample;
``DIR/val-000000.tar`` ... the held-out samples, and ``classes.json`` the class names, when
:mod:`.write_shards` wrote them.

A shard is read with the standard ``tarfile`` module, uncompressed, and never extracted to disk: the scan
reads the headers alone (plus the few bytes of each ``.cls``) and refuses, in one line naming the shard and
the member, anything but regular files with plain relative names (no absolute names, no ``..``, no links or
devices), members above the size an image may hold, more than ``MAX_MEMBERS``, a sample without its image or
its class, or a class outside ``0 .. classes - 1``. Each sample is then an offset and a length in its shard,
read and decoded when it is used, bounded and checked as :mod:`.image_decode` says (the cap on a decoded
sample, 16-bit grey kept, NaN refused). The scanned index serves both the shuffled stream of
:mod:`.shard_stream` and random access (checks, the held-out split).
"""

from __future__ import annotations

import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch
from torch.utils.data import Dataset

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import read_json_object, short

from .image_decode import NPY_SUFFIX, PIL_SUFFIXES, decode_bytes, sample_limit, shown
from .image_folder import MAX_FILE_BYTES, has_pil

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


def decode_sample(sample: TarSample, limit: int | None = None) -> torch.Tensor:
    """The sample's image as float32 C x H x W, read from its shard (``limit``: the cap on its decoded bytes)."""
    where = f"{shown(sample.shard)}: {shown(sample.key)}{sample.suffix}"
    if sample.size > MAX_FILE_BYTES:
        raise PrunusError(f"{where}: {sample.size:,} bytes, above the {MAX_FILE_BYTES:,} an image may hold")
    with open(sample.shard, "rb") as f:
        f.seek(sample.offset)
        data = f.read(sample.size)
    if len(data) != sample.size:
        raise PrunusError(f"{where}: the shard ends inside the image; write the shard again")
    return decode_bytes(data, sample.suffix, where, sample_limit() if limit is None else limit)


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


class TarSampleDataset(Dataset):
    """Random access to scanned samples: (image, class index); every image of the shape of the first; ``limit``:
    the cap on a decoded sample's bytes (default ``PRUNUS_MAX_SAMPLE_MB``)."""

    finite_checked = True  # every float sample is checked at decode (image_decode.check_finite)

    def __init__(self, samples: list[TarSample], classes: list[str] | None, limit: int | None = None):
        if not has_pil() and any(s.suffix != NPY_SUFFIX for s in samples[:1]):
            raise PrunusError(f"{shown(samples[0].shard)}: Pillow is not installed, so only .npy images are read; pip "
                              "install pillow")
        self.samples, self.classes, self.limit = samples, classes, sample_limit() if limit is None else limit
        self.shape = tuple(decode_sample(samples[0], self.limit).shape)

    @property
    def num_classes(self) -> int:
        """The classes of classes.json, else the largest class index of the samples + 1."""
        return len(self.classes) if self.classes else max(s.label for s in self.samples) + 1

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, sample: TarSample):
        image = decode_sample(sample, self.limit)
        if tuple(image.shape) != self.shape:
            raise PrunusError(f"{shown(sample.shard)}: {shown(sample.key)}{sample.suffix} decodes to "
                              f"{tuple(image.shape)}, not {self.shape} as the first sample; resize the images to one size")
        return image, torch.tensor(sample.label)

    def __getitem__(self, i: int):
        return self.load(self.samples[i])
