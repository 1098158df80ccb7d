"""Image data within bounds: a decoded sample capped from its header before any pixel is decoded (the
decompression bomb), 16-bit grey kept at 16 bits, NaN / infinity refused naming the sample, a seeded and
time-bounded fuzz of the image reader, and data that does not fit the module (channels, classes, a class
folder whose name is not UTF-8) refused in one line before training, through the CLI (exit 2, no run dir)."""

from __future__ import annotations

import io
import os
import random
import struct
import tarfile
import time
import tracemalloc
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from prunus.artifacts.errors import PrunusError
from prunus.cli.main import cli
from prunus.data.global_batches import step_batches
from prunus.data.image_decode import decode_bytes
from prunus.data.image_folder import image_folder_datasets, sample_shape
from prunus.data.module_datasets import module_datasets
from prunus.train_parallel.module_config import ModuleTrainConfig
from prunus.train_parallel.module_trainer import train_module

Image = pytest.importorskip("PIL.Image")
ImageFile = pytest.importorskip("PIL.ImageFile")
MB = 1 << 20


def cnn(channels=3, classes=2):
    """A tiny CNN (the factory "test_data_bounds:cnn")."""
    return nn.Sequential(nn.Conv2d(channels, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, classes))


# --- files ------------------------------------------------------------------------------------------------------

def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png(w: int, h: int, *, color: int = 2, depth: int = 8, rows: int | None = None) -> bytes:
    """A PNG of zero pixels, compressed row by row (a bomb needs no memory to build); ``rows``: fewer rows."""
    bpp = {0: 1, 2: 3, 4: 2, 6: 4}[color] * depth // 8
    z, row = zlib.compressobj(9), b"\0" * (1 + w * bpp)
    body = b"".join(z.compress(row) for _ in range(h if rows is None else rows)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, depth, color, 0, 0, 0))
            + _chunk(b"IDAT", body) + _chunk(b"IEND", b""))


def _saved(image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _pfm(values: np.ndarray) -> bytes:
    h, w = values.shape
    return f"Pf\n{w} {h}\n-1.0\n".encode() + values[::-1].astype("<f4").tobytes()


def _folder(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        path = root / os.fsdecode(name.encode() if isinstance(name, str) else name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def _rgb_folder(root: Path, classes: int = 2, per_class: int = 4, size: int = 8) -> Path:
    gen = np.random.default_rng(0)
    return _folder(root, {f"c{c}/{i}.png": _saved(Image.fromarray((gen.random((size, size, 3)) * 255).astype(np.uint8)),
                                                  "PNG") for c in range(classes) for i in range(per_class)})


class _LoadCounter:
    """Counts Pillow's pixel decodes (ImageFile.load) while installed."""

    def __init__(self, monkeypatch):
        self.calls, original = 0, ImageFile.ImageFile.load

        def load(im, *a, **k):
            self.calls += 1
            return original(im, *a, **k)

        monkeypatch.setattr(ImageFile.ImageFile, "load", load)


def _refused_small(call, needle: str, monkeypatch) -> PrunusError:
    """``call()`` refuses in one line holding ``needle`` in under a second, no pixel decoded, under 4 MiB traced."""
    counter = _LoadCounter(monkeypatch)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(PrunusError) as e:
            call()
        elapsed, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert counter.calls == 0 and elapsed < 1.0 and peak < 4 * MB, (counter.calls, elapsed, peak)
    return e.value


# --- the cap on a decoded sample ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bomb() -> bytes:
    """A 4096 x 4096 RGB PNG of zeros: tens of KB that decode to 192 MiB of float32."""
    data = _png(4096, 4096)
    assert len(data) < 200_000
    return data


def test_a_decompression_bomb_is_refused_from_its_header(bomb, tmp_path, monkeypatch):
    Image.open(io.BytesIO(b"\x89PNG\r\n\x1a\n" + bomb[8:])).close()  # Pillow's plugins imported before measuring
    monkeypatch.delenv("PRUNUS_MAX_SAMPLE_MB", raising=False)
    err = _refused_small(lambda: decode_bytes(bomb, ".png", "b.png", 64 * MB), "decodes to 201,326,592 bytes",
                         monkeypatch)
    assert str(err).startswith("b.png: 3 x 4096 x 4096") and "PRUNUS_MAX_SAMPLE_MB" in str(err)
    folder = _folder(tmp_path / "f", {"a/bomb.png": bomb, "b/ok.png": _png(8, 8)})
    _refused_small(lambda: image_folder_datasets(folder), f"{folder}/a/bomb.png: 3 x 4096 x 4096", monkeypatch)
    shards = tmp_path / "s"
    shards.mkdir()
    with tarfile.open(shards / "shard-000000.tar", "w") as tar:
        for name, data in [("a.png", _png(8, 8)), ("a.cls", b"0"), ("b.png", bomb), ("b.cls", b"1")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    stream, _ = module_datasets(str(shards))
    _refused_small(lambda: stream[1], "shard-000000.tar: b.png: 3 x 4096 x 4096", monkeypatch)


def test_the_cap_is_configurable_and_checked(bomb, tmp_path, monkeypatch):
    path = tmp_path / "bomb.png"
    path.write_bytes(bomb)
    monkeypatch.setenv("PRUNUS_MAX_SAMPLE_MB", "256")
    assert sample_shape(path) == (3, 4096, 4096)  # the header alone: under a raised cap it passes
    monkeypatch.setenv("PRUNUS_MAX_SAMPLE_MB", "lots")
    with pytest.raises(PrunusError, match="PRUNUS_MAX_SAMPLE_MB='lots': give a whole number of MiB"):
        sample_shape(path)
    monkeypatch.delenv("PRUNUS_MAX_SAMPLE_MB")
    small = _folder(tmp_path / "f", {"a/x.png": _png(8, 8), "b/y.npy": _npy(np.zeros((3, 8, 8), np.float32))})
    with pytest.raises(PrunusError, match=r"x.png: 3 x 8 x 8 \(C x H x W\) decodes to 768 bytes of float32, above "
                                          r"the 500 a sample may take"):
        image_folder_datasets(small, max_sample_bytes=500)
    assert len(image_folder_datasets(small, max_sample_bytes=768)[0]) >= 1


def test_pillows_bomb_limit_stays_and_its_warning_is_a_refusal(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    for side in (40, 80):  # above the limit (Pillow's warning), and above twice it (Pillow's error)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing leaks out as a warning either
            with pytest.raises(PrunusError, match="decompression-bomb limit .*MAX_IMAGE_PIXELS = 1,000"):
                decode_bytes(_png(side, side, color=0), ".png", "p.png", 64 * MB)
    assert decode_bytes(_png(30, 30, color=0), ".png", "p.png", 64 * MB).shape == (1, 30, 30)


def test_a_huge_header_with_a_tiny_body_allocates_nothing(monkeypatch):
    header = (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", 65000, 65000, 8, 2, 0, 0, 0))
              + _chunk(b"IDAT", zlib.compress(b"\0" * 64)) + _chunk(b"IEND", b""))
    _refused_small(lambda: decode_bytes(header, ".png", "h.png", 64 * MB), "h.png", monkeypatch)
    npy = _npy(np.zeros((2, 2), np.float32)).replace(b"(2, 2)", b"(9999, 9999)")  # the same header length
    assert b"(9999, 9999)" in npy
    _refused_small(lambda: decode_bytes(npy, ".npy", "n.npy", 512 * MB),
                   "n.npy: its header says (1, 9999, 9999) of float32 (399,920,004 bytes), but", monkeypatch)
    jpeg = bytearray(_saved(Image.new("RGB", (8, 8)), "JPEG"))
    sof = jpeg.index(b"\xff\xc0")
    jpeg[sof + 5:sof + 9] = struct.pack(">HH", 60000, 60000)
    _refused_small(lambda: decode_bytes(bytes(jpeg), ".jpg", "j.jpg", 64 * MB), "j.jpg", monkeypatch)


# --- bit depth and modes ------------------------------------------------------------------------------------------

def test_16_bit_grey_keeps_its_64_distinct_values(tmp_path):
    values = (np.arange(64, dtype=np.uint16) * 1000 + 7).reshape(8, 8)
    png = _saved(Image.fromarray(values), "PNG")
    pgm = b"P5\n8 8\n65535\n" + values.astype(">u2").tobytes()
    for name, data in (("g.png", png), ("g.pgm", pgm)):
        x = decode_bytes(data, Path(name).suffix, name, 64 * MB)
        assert x.shape == (1, 8, 8) and x.dtype == torch.float32
        assert len(torch.unique(x)) == 64, name
        assert torch.allclose(x[0], torch.from_numpy(values.astype(np.float32) / 65535), atol=0, rtol=1e-6), name
        (tmp_path / name).write_bytes(data)
        assert sample_shape(tmp_path / name) == (1, 8, 8)


def test_16_bit_colour_is_refused_rather_than_cut():
    for name, data in (("c.png", _png(4, 4, color=2, depth=16)), ("a.png", _png(4, 4, color=6, depth=16)),
                       ("ga.png", _png(4, 4, color=4, depth=16)),
                       ("c.ppm", b"P6\n1 1\n65535\n" + struct.pack(">HHH", 65535, 1000, 0))):
        with pytest.raises(PrunusError, match=rf"{name}: 16-bit \w+ samples, which Pillow reads as 8 bits"):
            decode_bytes(data, Path(name).suffix, name, 64 * MB)


def test_palette_alpha_and_bilevel_modes():
    gen = np.random.default_rng(1)
    rgb = Image.fromarray((gen.random((6, 5, 3)) * 255).astype(np.uint8))
    cases = {"RGB": (rgb, 3), "RGBA": (rgb.convert("RGBA"), 3), "P": (rgb.convert("P"), 3),
             "LA": (rgb.convert("LA"), 3), "L": (rgb.convert("L"), 1), "1": (rgb.convert("1"), 1)}
    for mode, (image, channels) in cases.items():
        x = decode_bytes(_saved(image, "PNG"), ".png", f"{mode}.png", 64 * MB)
        assert x.shape == (channels, 6, 5) and 0 <= float(x.min()) and float(x.max()) <= 1, mode
    x = decode_bytes(_saved(rgb, "JPEG"), ".jpg", "a.jpg", 64 * MB)
    assert x.shape == (3, 6, 5) and float(x.max()) <= 1
    binary = decode_bytes(_saved(rgb.convert("1"), "PNG"), ".png", "b.png", 64 * MB)
    assert set(torch.unique(binary).tolist()) <= {0.0, 1.0}


def test_only_the_image_readers_named_are_used():
    """A .png holding another format Pillow knows (here a GIF, or an EPS that would start Ghostscript) is refused."""
    gif = _saved(Image.new("L", (4, 4)), "GIF")
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 4 4\n"
    for data in (gif, eps):
        with pytest.raises(PrunusError, match="x.png: not a PNG, JPEG or PPM / PGM image Pillow reads"):
            decode_bytes(data, ".png", "x.png", 64 * MB)


# --- NaN and infinity ---------------------------------------------------------------------------------------------

def test_nan_and_inf_in_float_samples_are_refused_naming_them(tmp_path):
    nan = np.ones((1, 4, 4), np.float32)
    nan[0, 1, 2] = np.nan
    with pytest.raises(PrunusError, match=r"n.npy: 1 NaN among its 16 values; fix or remove the sample"):
        decode_bytes(_npy(nan), ".npy", "n.npy", 64 * MB)
    big = np.full((4, 4), 1e300)  # finite float64, infinite as float32
    with pytest.raises(PrunusError, match=r"b.npy: 16 infinite among its 16 values"):
        decode_bytes(_npy(big), ".npy", "b.npy", 64 * MB)
    pfm = np.ones((3, 3), np.float32)
    pfm[2, 2] = -np.inf
    with pytest.raises(PrunusError, match=r"p.pgm: 1 infinite among its 9 values"):
        decode_bytes(_pfm(pfm), ".pgm", "p.pgm", 64 * MB)
    assert torch.equal(decode_bytes(_pfm(np.eye(3, dtype=np.float32)), ".pgm", "e.pgm", 64 * MB)[0], torch.eye(3))
    folder = _folder(tmp_path / "f", {f"c{c}/{i}.npy": _npy(np.ones((1, 4, 4), np.float32)) for c in range(2)
                                      for i in range(3)})
    (folder / "c1" / "2.npy").write_bytes(_npy(nan))
    train, val = image_folder_datasets(folder)
    both = {p: (ds, i) for ds in (train, val) for i, (p, _) in enumerate(ds.files)}
    ds, i = both[folder / "c1" / "2.npy"]
    with pytest.raises(PrunusError, match=r"c1/2.npy: 1 NaN among its 16 values"):
        ds[i]


def _nan_shards(root: Path) -> Path:
    root.mkdir()
    for k in range(2):
        with tarfile.open(root / f"shard-{k:06d}.tar", "w") as tar:
            for i in range(4):
                array = np.ones((1, 4, 4), np.float32)
                array[0, 0, 0] = np.nan if (k, i) == (1, 2) else 1.0
                for name, data in ((f"s{k}_{i}.npy", _npy(array)), (f"s{k}_{i}.cls", b"0")):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return root


@pytest.mark.parametrize("workers", [0, 2])
def test_a_nan_in_a_shard_is_one_line_from_a_dataloader_worker_too(tmp_path, workers):
    stream, _ = module_datasets(str(_nan_shards(tmp_path / "s")))
    batches = step_batches(stream, 4, seed=0, workers=workers)
    with pytest.raises(PrunusError) as e:
        for step in range(4):  # two epochs: the sample comes up
            batches.batch(step)
    assert str(e.value) == f"{tmp_path / 's' / 'shard-000001.tar'}: s1_2.npy: 1 NaN among its 16 values; fix or " \
                           "remove the sample (a model trained on them is NaN)"


class _Floats(torch.utils.data.Dataset):
    """A user's dataset of 16 samples, sample ``bad`` holding a NaN in its input."""

    def __init__(self, bad: int):
        self.bad = bad

    def __len__(self):
        return 16

    def __getitem__(self, i):
        x = torch.full((8,), float(i) / 16)
        if i == self.bad:
            x[3] = float("nan")
        return x, torch.tensor(i % 2)


def test_a_python_dataset_with_nan_is_refused_naming_the_sample(tmp_path):
    cfg = ModuleTrainConfig(out=str(tmp_path / "run"), steps=8, batch_size=4, warmup_steps=1, eval_every=100,
                            ckpt_every=0, progress=False)
    with pytest.raises(PrunusError, match=r"^dataset\[5\]\[0\] \(input\): 1 NaN among its 8 values"):
        train_module("test_any_model:two_linear", _Floats(5), "classification", cfg)
    assert not (tmp_path / "run").exists()
    with pytest.raises(PrunusError, match=r"^dataset\[0\]\[0\] \(input\): 1 NaN"):  # the held-out split as well
        train_module("test_any_model:two_linear", _Floats(99), "classification", cfg, val_dataset=_Floats(0))
    assert not (tmp_path / "run").exists()


# --- fuzz ---------------------------------------------------------------------------------------------------------

def _bases() -> list[tuple[str, bytes]]:
    gen = np.random.default_rng(2)
    rgb = Image.fromarray((gen.random((5, 7, 3)) * 255).astype(np.uint8))
    grey16 = Image.fromarray((gen.random((5, 7)) * 65535).astype(np.uint16))
    out = [(".png", _saved(rgb.convert(m), "PNG")) for m in ("RGB", "RGBA", "P", "LA", "L", "1")]
    out += [(".png", _saved(grey16, "PNG")), (".png", _png(3, 2, color=2, depth=16))]
    out += [(".jpg", _saved(rgb, "JPEG")), (".jpeg", _saved(rgb.convert("L"), "JPEG", progressive=True)),
            (".ppm", _saved(rgb, "PPM")), (".pgm", _saved(rgb.convert("L"), "PPM")),
            (".pgm", b"P5\n7 5\n65535\n" + (gen.random(35) * 65535).astype(">u2").tobytes()),
            (".pgm", _pfm(gen.random((5, 7)).astype(np.float32)))]
    out += [(".npy", _npy(gen.random(s).astype(d))) for s, d in (((5, 7), np.float32), ((3, 5, 7), np.float64),
                                                                   ((1, 5, 7), np.uint8), ((2, 5, 7), np.int16))]
    return out


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(6)
    if kind == 0:  # truncated
        return bytes(b[:rng.randrange(len(b))])
    if kind == 1:  # bytes flipped
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if kind == 2:  # a run cut out or repeated
        i, j = sorted(rng.randrange(len(b)) for _ in range(2))
        return bytes(b[:i] + b[j:]) if rng.random() < 0.5 else bytes(b[:j] + b[i:j] + b[j:])
    if kind == 3:  # the magic kept, the rest random
        return bytes(b[:8]) + rng.randbytes(rng.randrange(200))
    if kind == 4:  # a huge size in the header, the body as it was
        size = struct.pack(">II", *(rng.choice([0, 1, 2**15, 2**24, 2**31 - 1]) for _ in range(2)))
        if data.startswith(b"\x89PNG"):
            ihdr = size + bytes(b[24:29])
            return bytes(b[:8]) + _chunk(b"IHDR", ihdr) + bytes(b[33:])
        i = rng.randrange(max(1, len(b) - 8))
        return bytes(b[:i] + size + b[i + 8:])
    return rng.randbytes(rng.randrange(64))  # noise


def test_fuzzed_images_give_a_sample_or_one_line(tmp_path):
    """Seeded, 3 s at most: damaged PNG / JPEG / PPM / PFM / .npy bytes, huge headers on tiny bodies, 16-bit, palette
    and alpha modes. Each gives a finite float32 C x H x W sample within the cap, or one PrunusError line."""
    rng, bases = random.Random(1234), _bases()
    limit, cases, deadline, outcomes = MB, 0, time.monotonic() + 3.0, {"sample": 0, "refused": 0}
    while time.monotonic() < deadline and cases < 2000:
        suffix, base = bases[cases % len(bases)]
        data = base if cases < len(bases) else _mutate(rng, base)
        try:
            x = decode_bytes(data, suffix, "fuzz" + suffix, limit)
        except PrunusError as e:
            outcomes["refused"] += 1
            assert "\n" not in str(e) and str(e).startswith("fuzz" + suffix), str(e)
        else:
            outcomes["sample"] += 1
            assert x.dtype == torch.float32 and x.ndim == 3 and 4 * x.numel() <= limit
            assert bool(torch.isfinite(x).all())
        if cases % 7 == 0:  # the header-only check of a file, as an image folder makes it
            path = tmp_path / f"f{cases % 5}{suffix}"
            path.write_bytes(data)
            try:
                shape = sample_shape(path, limit)
                assert len(shape) == 3 and 4 * np.prod(shape) <= limit
            except PrunusError as e:
                assert "\n" not in str(e), str(e)
        cases += 1
    assert cases >= 2 * len(bases), cases
    assert outcomes["sample"] > len(bases) // 2 and outcomes["refused"] > cases // 4, outcomes


# --- data that does not fit the module, through the CLI ----------------------------------------------------------

def _train(tmp_path, data, *extra):
    return CliRunner().invoke(cli, ["train", "--model", "test_data_bounds:cnn", "--data", str(data), "--steps", "6",
                                    "--batch-size", "4", "--warmup-steps", "1", "--eval-every", "3", "--ckpt-every",
                                    "0", "--out", str(tmp_path / "run"), "--no-progress", *extra])


def test_cli_data_that_does_not_fit_the_module_is_one_line_before_training(tmp_path, assert_user_error):
    rgb = _rgb_folder(tmp_path / "rgb", classes=3)
    cases = [
        (["--model-args", "channels=1,classes=3"], "samples of shape (3, 8, 8) do not fit the module: its first "
         "convolution (0) takes 1 channel and the images have 3; build it with 3 input channels"),
        (["--model-args", "channels=3,classes=2"], "3 classes, but the module scores 2; build it with 3 outputs"),
        (["--model-args", "channels=3,classes=2", "--nproc", "2"], "3 classes, but the module scores 2"),
    ]
    for extra, needle in cases:
        result = _train(tmp_path, rgb, *extra)
        assert_user_error(result, f"--data {rgb}: {needle}")
        assert not (tmp_path / "run").exists()
    shards, png = tmp_path / "shards", (tmp_path / "rgb" / "c0" / "0.png").read_bytes()
    shards.mkdir()  # no classes.json: the classes are the largest index + 1
    with tarfile.open(shards / "shard-000000.tar", "w") as tar:
        for i in range(4):
            for name, data in ((f"k{i}.png", png), (f"k{i}.cls", b"%d" % i)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    assert_user_error(_train(tmp_path, shards, "--model-args", "classes=3"), "4 classes, but the module scores 3")
    assert _train(tmp_path, rgb, "--model-args", "classes=3").exit_code == 0  # the same data fits a 3-class module


def test_cli_bombs_nan_and_non_utf8_class_names_are_one_line(tmp_path, assert_user_error, bomb):
    folder = _rgb_folder(tmp_path / "b")
    for i in range(8):
        (folder / "c0" / f"bomb{i}.png").write_bytes(bomb)
    assert_user_error(_train(tmp_path, folder), "bomb0.png: 3 x 4096 x 4096 (C x H x W) decodes to 201,326,592")
    odd = _rgb_folder(tmp_path / "u")
    os.rename(odd / "c1" / "0.png", os.fsencode(odd) + b"/c1/\xff.png")  # a file's name may be any bytes
    train, val = image_folder_datasets(odd)
    assert len(train) + len(val) == 8 and all(x.shape == (3, 8, 8) for x, _ in (*train, *val))
    os.rename(odd / "c1", os.fsencode(odd) + b"/caf\xe9")  # a class folder's is recorded as text: UTF-8
    assert_user_error(_train(tmp_path, odd), "the class folder b'caf\\xe9' has a name that is not UTF-8; rename it")
    nan = _folder(tmp_path / "n", {f"c{c}/{i}.npy": _npy(np.full((3, 8, 8), 0.5, np.float32)) for c in range(2)
                                   for i in range(6)})
    bad = np.full((3, 8, 8), 0.5, np.float32)
    bad[1, 2, 3] = np.nan
    (nan / "c1" / "4.npy").write_bytes(_npy(bad))  # not the first sample: found while training
    result = _train(tmp_path, nan)
    assert_user_error(result, "c1/4.npy: 1 NaN among its 192 values; fix or remove the sample")
    assert not (tmp_path / "run").exists() and "Traceback" not in result.output
