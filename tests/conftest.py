"""Shared fixtures: tiny models, small corpora, one trained run reused by the CLI tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Passive OpenMP waiting, as `make test` and every prunus command set it; it must precede torch's import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from prunus.models import Transformer, get_preset
from prunus.train_parallel import TrainConfig, train

# helper modules beside the tests (hf_family_cases: the Hugging Face family table) import by name; none
# shares a name with a prunus module
sys.path.insert(0, str(Path(__file__).parent))

# A tiny run: seconds on 2 CPU cores, on a slice of the built-in corpus.
TINY_RUN = dict(preset="tiny", seq_len=32, batch_size=4, steps=6, warmup_steps=2, eval_every=3, eval_tokens=2048,
                ckpt_every=0, max_corpus_bytes=200_000, progress=False)


@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    return model.eval()


@pytest.fixture
def tiny_cfg():
    """TrainConfig of a tiny run writing to ``out``, with changes."""
    return lambda out, **changes: TrainConfig(out=str(out), **{**TINY_RUN, **changes})


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """A finished tiny run (read-only for tests: copy before changing it)."""
    out = tmp_path_factory.mktemp("runs") / "tiny"
    train(TrainConfig(out=str(out), **TINY_RUN))
    return out


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    return path


def _assert_user_error(result, *needles):
    """A CLI result that is a user's mistake: exit code 2, one ``Error:`` line holding every needle."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.fixture
def assert_user_error():
    return _assert_user_error


def _child_pids(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (Linux /proc)."""
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d.name))
    return kids


@pytest.fixture
def children():
    return _child_pids


def _spawn_jobs(worker, nproc: int, jobs: list[dict], tmp_path) -> dict:
    """Run ``jobs`` in one torchrun process group of ``nproc`` ranks (one thread each) with the
    ``worker`` script; return what its rank 0 wrote, by job name."""
    spec, out = Path(tmp_path) / f"spec{nproc}.json", Path(tmp_path) / f"out{nproc}.json"
    spec.write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(worker), str(spec), str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def spawn_jobs():
    return _spawn_jobs
