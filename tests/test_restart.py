"""A rank killed with SIGKILL mid-run: torchrun --max-restarts brings the job back from the
last checkpoint, and it ends exactly where an uninterrupted run ends."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from prunus.cli.main import cli
from prunus.train_parallel import read_metrics

ARGS = ["--preset", "tiny", "--seq-len", "64", "--batch-size", "16", "--warmup-steps", "1", "--eval-every", "100",
        "--eval-tokens", "1024", "--max-corpus-bytes", "200000", "--no-progress", "--steps", "30", "--ckpt-every", "10"]


def _steps_logged(run_dir: Path) -> int:
    f = run_dir / "metrics.jsonl"
    return f.read_text().count('"step"') if f.is_file() else 0


def test_sigkilled_rank_restarts_from_checkpoint_and_matches(tmp_path, children):
    ref = CliRunner().invoke(cli, ["train", *ARGS, "--out", str(tmp_path / "ref")])
    assert ref.exit_code == 0, ref.output

    job = tmp_path / "job"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
         "-m", "prunus.cli.main", "train", *[a for a in ARGS if a != "--no-progress"], "--out", str(job)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while _steps_logged(job) < 12 and agent.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert agent.poll() is None and _steps_logged(job) < 30, "the run ended before a rank could be killed"
        workers = sorted(children(agent.pid))
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)  # after the step-10 checkpoint, before the end
        out, _ = agent.communicate(timeout=300)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, out[-3000:]
    assert "exitcode: -9" in out and "steps 11..30 of 30" in out  # killed, then resumed from step-10

    ours, theirs = read_metrics(job), read_metrics(tmp_path / "ref")
    assert [r["step"] for r in ours] == list(range(1, 31))
    for a, b in zip(ours, theirs):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
    assert (job / "model" / "prunus.json").is_file()
