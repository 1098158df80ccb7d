"""Tar shards (WebDataset layout): writing them from an image folder, the bounded reader, the stream split by
rank and DataLoader worker with its seeded shuffle buffer, and the exact resume of a training run on them.
Tiny PNG images (Pillow) and the CNN of test_any_model."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.data.global_batches import step_batches
from prunus.data.image_folder import image_folder_datasets
from prunus.data.module_datasets import module_datasets
from prunus.data.shard_stream import TarShardStream
from prunus.data.tar_shards import scan_shard
from prunus.data.write_shards import main as write_main
from prunus.data.write_shards import write_shards
from prunus.train_parallel.module_config import ModuleTrainConfig
from prunus.train_parallel.module_trainer import train_module

PIL = pytest.importorskip("PIL.Image")
BASE = dict(steps=4, batch_size=4, warmup_steps=1, eval_every=2, ckpt_every=0, progress=False, lr=1e-2)


def _png_folder(root: Path, per_class: int = 8) -> Path:
    gen = np.random.default_rng(0)
    for c, name in enumerate(["ant", "bee"]):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = (gen.random((8, 8, 3)) * 100 + 100 * c).astype(np.uint8)
            PIL.fromarray(pixels).save(root / name / f"img {i}.png")
    return root


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("shards")
    folder = _png_folder(tmp / "folder")
    assert write_main([str(folder), str(tmp / "shards"), "--per-shard", "3", "--val-fraction", "0.2"]) == 0
    return folder, tmp / "shards"


def test_shards_hold_the_folders_images_and_classes(shards):
    folder, out = shards
    train_f, val_f = image_folder_datasets(folder, 0.2)
    train, val = module_datasets(str(out))
    assert isinstance(train, TarShardStream) and train.classes == ["ant", "bee"] and train.shape == (3, 8, 8)
    assert len(train) == len(train_f) and len(val) == len(val_f) >= 1
    assert sorted(p.name for p in out.iterdir())[:2] == ["classes.json", "shard-000000.tar"]
    assert len(list(out.glob("shard-*.tar"))) == -(-len(train_f) // 3)
    mine = sorted((float(x.sum()), int(y)) for x, y in (train[i] for i in range(len(train))))
    theirs = sorted((float(x.sum()), int(y)) for x, y in (train_f[i] for i in range(len(train_f))))
    assert mine == theirs  # the same pixels and labels, decoded from the tar members
    with tarfile.open(out / "shard-000000.tar") as tar:
        assert tar.getnames()[:2] == ["0_img_0.png", "0_img_0.cls"]


def test_the_stream_splits_by_rank_and_worker_and_shuffles_by_seed(shards):
    _, out = shards
    stream, _ = module_datasets(str(out), shuffle_buffer=4)
    stored = [s.key for s in stream.index.samples]
    parts = [[s.key for s in stream.epoch_order(0, reader, 3)] for reader in range(3)]
    assert sorted(k for p in parts for k in p) == sorted(stored)  # every sample once an epoch, by one reader
    assert all(parts) and not set(parts[0]) & set(parts[1])
    whole = [s.key for s in stream.epoch_order(0, 0, 1)]
    assert whole == [s.key for s in stream.epoch_order(0, 0, 1)] and whole != stored  # seeded, shuffled
    assert whole != [s.key for s in stream.epoch_order(1, 0, 1)]  # another order each epoch
    stream.seed = 1
    assert [s.key for s in stream.epoch_order(0, 0, 1)] != whole


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_started_at_step_s_gives_the_batches_of_an_unbroken_one(shards, workers):
    _, out = shards
    stream, _ = module_datasets(str(out), shuffle_buffer=4)
    whole = step_batches(stream, 4, seed=3, workers=workers)
    batches = [whole.batch(s) for s in range(7)]  # past one epoch (12 training samples)
    later = step_batches(stream, 4, seed=3, workers=workers)
    for s in (5, 6):
        x, y = later.batch(s)
        assert torch.equal(x, batches[s][0]) and torch.equal(y, batches[s][1])
    assert not torch.equal(batches[0][0], batches[3][0])


def test_training_on_shards_stops_and_resumes_exactly(shards, tmp_path):
    _, out = shards
    train, val = module_datasets(str(out))
    spec, args = "test_any_model:resnet", {"width": 4, "classes": 2}
    full = train_module(spec, train, "classification", ModuleTrainConfig(out=str(tmp_path / "full"), model_args=args,
                                                                         **BASE), val_dataset=val)
    half = ModuleTrainConfig(out=str(tmp_path / "half"), model_args=args, stop_at=2, **BASE)
    first = train_module(spec, train, "classification", half, val_dataset=val)
    step = next((tmp_path / "half" / "checkpoints").glob("step-*"))  # checkpoints/best holds the best weights only
    state = json.loads(step.joinpath("train_state.json").read_text())
    assert state["step"] == 2 and state["data_readers"] == 1
    with pytest.raises(PrunusError, match="streamed its shards with 1 readers .* now 2; resume with the same"):
        train_module(spec, train, "classification", ModuleTrainConfig(out=str(tmp_path / "half"), model_args=args,
                                                                      data_workers=2, **BASE), resume=True)
    rest = train_module(spec, train, "classification", ModuleTrainConfig(out=str(tmp_path / "half"), model_args=args,
                                                                         **BASE), val_dataset=val, resume=True)
    assert first.losses + rest.losses == pytest.approx(full.losses, abs=1e-6)
    assert rest.metrics["val_loss"] == pytest.approx(full.metrics["val_loss"], abs=1e-6)


# --- hostile and damaged shards ---------------------------------------------------------------------------------

def _tar(path: Path, members: list[tuple[str, bytes | None, bytes]]) -> Path:
    """A shard of (name, kind, data): kind None a file, else tarfile's type byte (SYMTYPE, DIRTYPE...)."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data) if kind is None else 0
            if kind is not None:
                info.type, info.linkname = kind, "/etc/passwd"
            tar.addfile(info, io.BytesIO(data) if kind is None else None)
    return path


def _png() -> bytes:
    buf = io.BytesIO()
    PIL.fromarray(np.zeros((4, 4), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("members, needle", [
    ([("../evil.png", None, b"x"), ("../evil.cls", None, b"0")], "member '../evil.png' is not a plain relative name"),
    ([("/abs.png", None, b"x")], "member '/abs.png' is not a plain relative name"),
    ([("a.png", tarfile.SYMTYPE, b"")], "member 'a.png' is a link, not a regular file"),
    ([("d.png", tarfile.DIRTYPE, b"")], "is a dir or device"),
    ([("a.png", None, b"png"), ("a.cls", None, b"7" * 64)], "a.cls' holds 64 bytes; a .cls holds a class index"),
    ([("a.png", None, b"png"), ("a.cls", None, b"cat")], "a.cls' holds 'cat', not a class index"),
    ([("a.png", None, b"png")], "sample 'a' has no .cls"),
    ([("a.cls", None, b"1")], "sample 'a' has no image"),
    ([("noext", None, b"1")], "member 'noext' has no KEY.extension name"),
])
def test_a_hostile_shard_is_one_line_and_nothing_is_extracted(tmp_path, members, needle):
    shard = _tar(tmp_path / "shard-000000.tar", members)
    with pytest.raises(PrunusError) as e:
        module_datasets(str(tmp_path))
    assert needle in str(e.value) and str(shard) in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-000000.tar"]  # nothing written beside it
    assert not Path("/tmp/evil.png").exists()


def test_damaged_and_compressed_shards_and_oversized_members(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "shard-000000.tar").write_bytes(b"not a tar at all" * 64)
    with pytest.raises(PrunusError, match="not a readable uncompressed tar"):
        scan_shard(tmp_path / "a" / "shard-000000.tar")
    with tarfile.open(tmp_path / "gz.tar", "w:gz") as tar:
        info = tarfile.TarInfo("a.cls")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"0"))
    with pytest.raises(PrunusError, match="not a readable uncompressed tar"):
        scan_shard(tmp_path / "gz.tar")
    from prunus.data import tar_shards

    monkeypatch.setattr(tar_shards, "MAX_FILE_BYTES", 10)
    shard = _tar(tmp_path / "big.tar", [("a.png", None, _png()), ("a.cls", None, b"0")])
    with pytest.raises(PrunusError, match=r"a.png' holds \d+ bytes, above the 10 an image may hold"):
        scan_shard(shard)
    monkeypatch.setattr(tar_shards, "MAX_FILE_BYTES", 64 << 20)
    (tmp_path / "link.tar").symlink_to(shard)
    with pytest.raises(PrunusError, match="link.tar: not a regular file"):
        scan_shard(tmp_path / "link.tar")
    with pytest.raises(PrunusError, match="'a.cls' holds '3', not a class index from 0 to 1"):
        scan_shard(_tar(tmp_path / "c.tar", [("a.png", None, _png()), ("a.cls", None, b"3")]), classes=2)


def test_the_writer_refuses_an_existing_output_and_the_readers_need_enough_shards(shards, tmp_path):
    folder, out = shards
    with pytest.raises(PrunusError, match="already exists; choose another output dir"):
        write_shards(folder, out)
    assert write_main([str(folder), str(out)]) == 2
    stream, _ = module_datasets(str(out))
    with pytest.raises(PrunusError, match=r"\d+ shards for 64 readers \(ranks x --data-workers\)"):
        step_batches(stream, 64, seed=0, world=32, workers=2)
