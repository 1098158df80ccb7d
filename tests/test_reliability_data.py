"""Never lose a user's data: an --out that is, contains or lies inside an input (through symlinks too) is
refused by every verb, --overwrite replaces only what prunus wrote, and a writer keeps the old artifact
until the new one is complete (an interrupted `train --overwrite` leaves the old run as it was)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from prunus.cli.main import cli
from prunus.artifacts.errors import PrunusError
from prunus.models import save_model
from prunus.artifacts.atomic import atomic_dir, clean_stale_temps
from tree_snapshot import snapshot

TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "4", "--warmup-steps", "1", "--eval-every", "2",
        "--eval-tokens", "512", "--ckpt-every", "0", "--no-progress"]


@pytest.fixture(scope="module")
def area(tmp_path_factory, trained_run):
    """A corpus dir D (and a symlink L to it), a model dir M, a Hugging Face dir H, a foreign dir X."""
    from prunus.models.hf_convert import to_hf

    root = tmp_path_factory.mktemp("dataloss")
    (root / "D").mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (root / "D" / name).write_text(f"{name}: the quick brown fox jumps over the lazy dog\n" * 300)
    (root / "L").symlink_to(root / "D")
    import shutil

    shutil.copytree(trained_run / "model", root / "M")
    to_hf(root / "M", root / "H")
    from prunus.models.gguf_write import to_gguf

    to_gguf(root / "M", root / "G.gguf")
    (root / "X").mkdir()
    (root / "X" / "notes.txt").write_text("a user's own files\n")
    return root


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


REFUSED = [  # (verb arguments with {root}, words of the one-line error)
    (["train", *TINY, "--steps", "2", "--data", "{r}/D", "--out", "{r}/D", "--overwrite"], ["is the input --data"]),
    (["train", *TINY, "--steps", "2", "--data", "{r}/D/a.txt", "--out", "{r}/D", "--overwrite"], ["contains the input --data"]),
    (["train", *TINY, "--steps", "2", "--data", "{r}/D", "--out", "{r}/L/run"], ["lies inside the input --data"]),
    (["train", *TINY, "--steps", "2", "--data", "{r}/L", "--out", "{r}", "--overwrite"], ["contains the input --data"]),
    (["export", "{r}/M", "--out", "{r}/M", "--overwrite"], ["is the input MODEL_DIR"]),
    (["export", "{r}/M", "--data", "{r}/L", "--out", "{r}/D/exp"], ["lies inside the input --data"]),
    (["convert", "--to-hf", "{r}/M", "--out", "{r}/M", "--overwrite"], ["is the input --to-hf"]),
    (["convert", "--to-hf", "{r}/M", "--out", "{r}/M/hf"], ["lies inside the input --to-hf"]),
    (["convert", "--from-hf", "{r}/H", "--out", "{r}/H", "--overwrite"], ["is the input --from-hf"]),
    (["compress", "{r}/M", "--quantize", "int8-weight-only", "--out", "{r}/M", "--overwrite"], ["is the input MODEL_DIR"]),
    (["compress", "{r}/M", "--quantize", "int8-weight-only", "--data", "{r}/D", "--out", "{r}/L/..", "--overwrite"],
     ["contains the input"]),
    (["convert", "--to-gguf", "{r}/M", "--out", "{r}/M/m.gguf"], ["lies inside the input --to-gguf"]),
    (["convert", "--from-gguf", "{r}/G.gguf", "--out", "{r}/G.gguf", "--overwrite"], ["is the input --from-gguf"]),
    (["export", "{r}/M", "--out", "{r}/X", "--overwrite"], ["prunus did not write", "--overwrite"]),
    (["convert", "--to-hf", "{r}/M", "--out", "{r}/X", "--overwrite"], ["prunus did not write"]),
]


@pytest.mark.parametrize("args, words", REFUSED, ids=[" ".join(a[:1] + a[-3:]) for a, _ in REFUSED])
def test_output_over_an_input_is_refused(area, args, words, assert_user_error):
    before = snapshot(area)
    r = run(*[a.replace("{r}", str(area)) for a in args])
    assert_user_error(r, *words)
    assert snapshot(area) == before


@pytest.mark.parametrize("verb", ["train", "export", "compress", "to_hf", "from_hf", "to_gguf", "from_gguf"])
def test_python_api_refuses_too(area, verb, tiny_cfg):
    """The check lives in each writer, not only in the CLI."""
    from prunus.compress import compress
    from prunus.export import export_model
    from prunus.models.gguf_read import from_gguf
    from prunus.models.gguf_write import to_gguf
    from prunus.models.hf_convert import from_hf, to_hf
    from prunus.train_parallel import train

    before = snapshot(area)
    calls = {
        "train": lambda: train(tiny_cfg(area / "L" / "run", data=str(area / "D"), steps=2)),
        "export": lambda: export_model(area / "M", area / "M" / "onnx"),
        "compress": lambda: compress(area / "M", [("quantize", {"scheme": "int8-weight-only"})], area, overwrite=True),
        "to_hf": lambda: to_hf(area / "M", area / "M", overwrite=True),
        "from_hf": lambda: from_hf(area / "H", area / "H" / "x"),
        "to_gguf": lambda: to_gguf(area / "L" / "..", area / "M" / "x.gguf"),
        "from_gguf": lambda: from_gguf(area / "G.gguf", area, overwrite=True),
    }
    with pytest.raises(PrunusError, match="writing there would destroy it"):
        calls[verb]()
    assert snapshot(area) == before


def test_train_over_its_data_in_a_subprocess(area):
    """The case that deleted a corpus, as a user runs it."""
    before = snapshot(area)
    proc = subprocess.run([sys.executable, "-m", "prunus.cli.main", "train", *TINY, "--steps", "2", "--data",
                           str(area / "D"), "--out", str(area / "D"), "--overwrite"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: --out") and "is the input --data" in lines[0], proc.stderr
    assert snapshot(area) == before


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.1)


def test_interrupted_overwrite_keeps_the_old_run(tmp_path, trained_run, text_file):
    """Ctrl-C in the middle of `train --overwrite`: the old run (its model dir included) is as it was; a
    finished overwrite replaces it whole and leaves no staging dir."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    before = snapshot(run_dir)
    cmd = [sys.executable, "-m", "prunus.cli.main", "train", *TINY, "--data", str(text_file), "--out", str(run_dir),
           "--overwrite", "--ckpt-every", "1"]
    # Ctrl-C reaches the child even when this suite runs with SIGINT ignored (a background job of a shell without
    # job control), which the child would otherwise inherit
    proc = subprocess.Popen([*cmd, "--steps", "100000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for(tmp_path / ".run.tmp-overwrite" / "checkpoints" / "step-1", proc)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"train did not stop within 60 s of SIGINT; its stderr: {proc.communicate()[1][-2000:]}")
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert snapshot(run_dir) == before
    r = subprocess.run([*cmd, "--steps", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "run"]
    assert (run_dir / "model" / "prunus.json").is_file() and snapshot(run_dir) != before
    assert '"steps": 2' in (run_dir / "run.json").read_text()


def test_a_failed_write_keeps_the_old_artifact_and_no_temp(tmp_path, tiny_model, monkeypatch):
    """Disk full while writing: one line, the previous output as it was, no temporary dir left."""
    out = tmp_path / "m"
    save_model(tiny_model, out, stage="test")
    before = snapshot(tmp_path)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("prunus.models.model_dir.save_file", full)
    with pytest.raises(PrunusError, match="no space left on the device"):
        save_model(tiny_model, out, stage="test", overwrite=True)
    assert snapshot(tmp_path) == before


def test_stale_temporaries_are_cleaned_and_files_readable(tmp_path, tiny_model):
    """A killed writer's `.X.tmp-PID` goes at the next write into the same parent; an `.X.old-PID` whose
    X is missing (killed between the two renames) is put back; model.safetensors gets the umask's mode."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / f".a.tmp-{pid}").mkdir()
    (tmp_path / f".a.tmp-{pid}" / "half.bin").write_bytes(b"x")
    (tmp_path / f".f.json.tmp-{pid}").write_text("{")
    (tmp_path / f".b.old-{pid}").mkdir()
    (tmp_path / f".b.old-{pid}" / "prunus.json").write_text("{}")
    (tmp_path / f".live.tmp-{os.getppid()}").mkdir()  # a running process's: kept
    save_model(tiny_model, tmp_path / "m", stage="test")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f".live.tmp-{os.getppid()}", "b", "m"], names
    mask = os.umask(0)
    os.umask(mask)
    for f in (tmp_path / "m").iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, f
    assert clean_stale_temps(tmp_path) == []


def test_atomic_dir_refuses_a_foreign_dir(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "thesis.tex").write_text("years of work")
    with pytest.raises(PrunusError, match="prunus did not write"):
        with atomic_dir(tmp_path / "docs", overwrite=True):
            pass
    assert (tmp_path / "docs" / "thesis.tex").read_text() == "years of work"
