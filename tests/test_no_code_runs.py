"""Nothing read from a run dir or a model dir executes: a pickle payload planted in any file prunus reads
(a checkpoint's ``.metadata``, its stored values, every other file of a run dir and of a model dir) never
runs, and the answer is one line, exit 2 (or, for a file the command does not need, success); a checkpoint
index naming files outside its dir is refused before anything is opened; and no prunus source file holds a
full unpickler call."""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from prunus.cli.main import cli
from prunus.models import save_model

TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "4", "--warmup-steps", "1", "--eval-every", "2",
        "--eval-tokens", "512", "--no-progress"]
ROOT = Path(__file__).resolve().parents[1]


class _Payload:
    """Unpickled with the full unpickler, this creates ``marker``: the proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _pickle_payload(marker: Path) -> bytes:
    return pickle.dumps(_Payload(marker), protocol=4)


def _torch_payload(marker: Path) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save({"x": _Payload(marker)}, buf)
    return buf.getvalue()


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _one_line_or_success(result) -> None:
    if result.exit_code == 0:
        return
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    out = tmp_path_factory.mktemp("ckpt") / "run"
    r = run("train", *TINY, "--steps", 6, "--ckpt-every", 2, "--stop-at", 4, "--data", corpus, "--out", out)
    assert r.exit_code == 0, r.output
    return out


def _rel_files(root: Path) -> list[str]:
    """Every file of a run dir, checkpoint files named once (the same name in every step dir)."""
    names = set()
    for p in root.rglob("*"):
        if p.is_file():
            rel = p.relative_to(root).as_posix()
            names.add(re.sub(r"checkpoints/step-\d+/", "checkpoints/step-*/", rel))
    return sorted(names)


@pytest.mark.parametrize("sizes", [False, True], ids=["as planted", "sizes rewritten"])
def test_every_run_dir_file_planted_with_a_payload(tmp_path, stopped_run, sizes):
    """Each file in turn (in every checkpoint at once) replaced by a pickle payload, and with ``sizes`` the
    checkpoint's record of its file sizes rewritten to match: `train --resume` and `info` run nothing and
    answer in one line (or resume, where the file is not needed)."""
    names = _rel_files(stopped_run)
    assert any(n.endswith(".metadata") for n in names) and any(n.endswith(".distcp") for n in names), names
    for i, name in enumerate(names):
        out, marker = tmp_path / f"run{i}", tmp_path / f"ran{i}"
        shutil.copytree(stopped_run, out)
        for target in out.glob(name):
            target.write_bytes(_pickle_payload(marker) if i % 2 == 0 else _torch_payload(marker))
            if sizes and target.parent.parent.name == "checkpoints" and target.name != "train_state.json":
                _doctor(target.parent, lambda ckpt, meta: None, metadata=False)
        for args in (("train", "--resume", "--out", out, "--no-progress"), ("info", out)):
            result = run(*args)
            assert not marker.exists(), (name, args)
            _one_line_or_success(result)
        shutil.rmtree(out)


def _doctor(ckpt: Path, edit, metadata: bool = True) -> None:
    """Rewrite a checkpoint's .metadata (the test's own file: the full unpickler is fine here) and its sizes."""
    if metadata:
        meta = pickle.loads((ckpt / ".metadata").read_bytes())
        edit(ckpt, meta)
        (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    state = json.loads((ckpt / "train_state.json").read_text())
    state["files"] = {p.name: p.stat().st_size for p in ckpt.iterdir() if p.name != "train_state.json"}
    (ckpt / "train_state.json").write_text(json.dumps(state))


def _plant_value(marker: Path):
    """Point one stored value (the learning rate) at a torch.save'd payload appended to the shard."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def edit(ckpt: Path, meta) -> None:
        index = next(k for k in meta.storage_data if k.fqn.endswith(".lr"))
        shard = ckpt / meta.storage_data[index].relative_path
        start, payload = shard.stat().st_size, _torch_payload(marker)
        shard.write_bytes(shard.read_bytes() + payload)
        meta.storage_data[index] = _StorageInfo(shard.name, start, len(payload))
    return edit


def _outside(ckpt: Path, meta) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    victim = ckpt.parents[2] / "victim.distcp"
    victim.write_bytes(b"\0" * 100_000)
    for index, info in list(meta.storage_data.items()):
        meta.storage_data[index] = _StorageInfo("../../../victim.distcp", info.offset, info.length)


@pytest.mark.parametrize("case", ["stored value", "outside the dir"])
def test_a_crafted_checkpoint_runs_and_reads_nothing(tmp_path, stopped_run, case, assert_user_error):
    out, marker = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(stopped_run, out)
    for ckpt in (out / "checkpoints").iterdir():
        _doctor(ckpt, _plant_value(marker) if case == "stored value" else _outside)
    result = run("train", "--resume", "--out", out, "--no-progress")
    assert not marker.exists()
    if case == "stored value":
        assert_user_error(result, "--resume", "is damaged", "cannot be read (UnpicklingError)")
    else:
        assert_user_error(result, "every checkpoint", "not a file of the checkpoint dir")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from prunus.models import Transformer, get_preset

    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    return save_model(model.eval(), tmp_path_factory.mktemp("good") / "m", stage="test")


def _rehash(d: Path) -> None:
    """Rewrite the manifest's hashes, as someone who plants a file on purpose would."""
    m = json.loads((d / "prunus.json").read_text())
    for name in m["files"]:
        m["files"][name] = hashlib.sha256((d / name).read_bytes()).hexdigest()
    (d / "prunus.json").write_text(json.dumps(m))


@pytest.mark.parametrize("rehash", [False, True], ids=["as planted", "manifest rehashed"])
def test_every_model_dir_file_planted_with_a_payload(tmp_path, model_dir, rehash, text_file):
    names = sorted(p.name for p in model_dir.iterdir() if p.is_file())
    assert {"config.json", "model.safetensors", "prunus.json"} <= set(names)
    for i, name in enumerate(names):
        d, marker = tmp_path / f"m{i}", tmp_path / f"ran{i}"
        shutil.copytree(model_dir, d)
        (d / name).write_bytes(_pickle_payload(marker) if i % 2 else _torch_payload(marker))
        if rehash and name != "prunus.json":
            _rehash(d)
        for args in (("generate", d, "--prompt", "x", "--max-new-tokens", 1), ("info", d), ("eval", d),
                     ("train", *TINY, "--steps", 1, "--init-from", d, "--data", text_file, "--out", tmp_path / f"o{i}")):
            result = run(*args)
            assert not marker.exists(), (name, args)
            _one_line_or_success(result)
            if args[0] != "info":  # info shows the manifest as it is; the others need the planted file
                assert result.exit_code == 2, (name, args, result.output)


_FULL_UNPICKLERS = [
    (re.compile(r"\bpickle\.loads?\("), "pickle.load"),
    (re.compile(r"\bdill\.|\bcloudpickle\.|\bjoblib\.load"), "a pickle library"),
    (re.compile(r"torch\.load\((?![^)]*weights_only=True)"), "torch.load without weights_only=True"),
    (re.compile(r"\bdcp\.load\((?![^)]*storage_reader=)"), "dcp.load with DCP's own reader"),
    (re.compile(r"\bFileSystemReader\("), "DCP's FileSystemReader"),
]


def test_no_prunus_source_holds_a_full_unpickler():
    """The class, not the instance: prunus's own code (benchmarks and tests aside) never calls one."""
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", "benchmarks", ".venv") or "site-packages" in rel.parts:
            continue
        text = path.read_text(encoding="utf-8")
        for pattern, what in _FULL_UNPICKLERS:
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                if not (rel.as_posix() == "train_parallel/checkpoint/checkpoint_reader.py" and what == "DCP's FileSystemReader"):
                    found.append(f"{rel}:{line}: {what}")
    assert not found, found
