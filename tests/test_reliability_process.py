"""Never leave a job running behind the user's back: a signal to `prunus train --nproc 2` reaches every
rank and the command waits for them; a launcher that dies takes its ranks with it; a hung rank ends the
job with one line naming the rank (issue 14, items 4 and 5)."""

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

TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "4", "--warmup-steps", "1", "--eval-every", "1000",
        "--eval-tokens", "512", "--no-progress", "--log-every", "1", "--steps", "100000", "--ckpt-every", "0"]


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == parent and int(d.name) not in found:
                found.add(int(d.name))
                todo.append(int(d.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_job(tmp_path: Path, text_file: Path, *extra: str) -> tuple[subprocess.Popen, set[int], Path]:
    """`prunus train --nproc 2` running its steps; (process, its rank processes, run dir)."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "prunus.cli.main", "train", *TINY, "--nproc", "2", "--data",
                             str(text_file), "--out", str(out), *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 240
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").stat().st_size:
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            pytest.fail(f"the job did not start: {proc.communicate()[1][-3000:]}")
        time.sleep(0.2)
    ranks = descendants(proc.pid)
    assert len(ranks) >= 2, ranks
    return proc, ranks, out


def wait_gone(pids, seconds: float) -> list[int]:
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def test_a_signal_to_the_launcher_ends_every_rank(tmp_path, text_file):
    proc, ranks, out = start_job(tmp_path, text_file)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert wait_gone(ranks, 20) == [], "ranks left running"
        size = (out / "metrics.jsonl").stat().st_size
        time.sleep(1)
        assert (out / "metrics.jsonl").stat().st_size == size  # nothing trains on
        assert proc.returncode == 128 + signal.SIGTERM
        assert err.strip().splitlines()[-1] == "prunus train: stopped by SIGTERM; all 2 ranks have exited", err
    finally:
        proc.kill()
        for p in ranks:
            if alive(p):
                os.kill(p, signal.SIGKILL)


RANK = """
import os, sys, time
os.environ.update(PRUNUS_LAUNCHER_PID=str(os.getppid()))
from prunus.train_parallel.launch.launch import die_with_launcher
die_with_launcher()
print("ready", flush=True)
time.sleep(120)
"""
LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_killed_launcher_takes_its_ranks_with_it():
    """SIGKILL gives the launcher no chance to forward anything: the kernel ends the rank (PR_SET_PDEATHSIG)."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK], stdout=subprocess.PIPE, text=True)
    try:
        rank = int(launcher.stdout.readline())
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        assert wait_gone([rank], 10) == []
    finally:
        launcher.kill()


def test_a_hung_rank_ends_the_job_with_one_line(tmp_path, text_file):
    """Rank 1 stops (SIGSTOP) mid-run: rank 0's next collective times out after --timeout and the job ends
    with one line naming the rank and the collective, no traceback."""
    timeout = 6
    proc, ranks, _ = start_job(tmp_path, text_file, "--timeout", str(timeout))
    hung = max(ranks)  # the second rank started
    try:
        os.kill(hung, signal.SIGSTOP)
        time.sleep(timeout + 4)
        os.kill(hung, signal.SIGCONT)  # lets the agent's SIGTERM end it without waiting its 30 s
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 2, err
        lines = [line for line in err.strip().splitlines() if line.strip()]
        assert len(lines) == 1, err
        assert lines[0].startswith("Error: rank 0: ") and f"timed out after --timeout {timeout} s" in lines[0], err
        assert wait_gone(ranks, 20) == []
    finally:
        proc.kill()
        for p in ranks:
            if alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "1e12"])
def test_timeout_is_validated(tmp_path, value, assert_user_error):
    r = CliRunner().invoke(cli, ["train", "--preset", "tiny", "--nproc", "2", "--timeout", value, "--out",
                                 str(tmp_path / "run")])
    assert_user_error(r, "--timeout" if value not in ("nan", "inf") else "timeout_s")
    assert not (tmp_path / "run").exists()
