"""Elastic training on one host over the loopback c10d rendezvous: two torchrun agents (``--nnodes 1:2``, one
process each) train one job; one agent is killed with its process group after a checkpoint exists; the survivor's
agent restarts the job (``--max-restarts 1``) with the world it gets (1), which resumes from the last complete
checkpoint and finishes with the losses of an uninterrupted one-process run from the same step."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from click.testing import CliRunner

from prunus.cli.main import cli
from prunus.train_parallel import read_metrics
from prunus.train_parallel.checkpoint.checkpoint import list_checkpoints

STEPS, EVERY = 60, 2
ARGS = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--warmup-steps", "1", "--eval-every", "1000",
        "--eval-tokens", "512", "--max-corpus-bytes", "100000", "--no-progress", "--log-every", "1",
        "--steps", str(STEPS), "--ckpt-every", str(EVERY)]
TOLERANCE = 1e-5  # the documented bound between layouts of the same global batch (docs/training.md)
DEADLINE_S = 240
# the rendezvous waits this long for the second agent once the first has joined (both start together), and again
# at the restart for a node that is not coming back
LAST_CALL_S = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(port: int, out: Path, log: Path, host: bool) -> subprocess.Popen:
    """One torchrun agent of the elastic job, in a session of its own (its 'node'); ``host``: it holds the
    rendezvous store (on a real cluster the node named by --rdzv-endpoint; the other node is the one lost)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "prunus-elastic-test",
           "--rdzv-conf", f"is_host={int(host)},last_call_timeout={LAST_CALL_S},join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3", "--max-restarts", "1", "--monitor-interval", "0.2",
           "-m", "prunus.cli.main", "train", *ARGS, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    with log.open("w") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for d in Path("/proc").iterdir():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) if d.name.isdigit() else -1
            except (OSError, ValueError, IndexError):
                continue
            if ppid == parent and int(d.name) not in found:
                found.add(int(d.name))
                todo.append(int(d.name))
    return found


def _kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL an agent, its workers (torchrun starts each in a session of its own) and their process groups."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        for kill, target in ((os.killpg, pid), (os.kill, pid)):
            try:
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    proc.wait(timeout=30)


def _wait(cond, procs, what: str, logs) -> None:
    end = time.monotonic() + DEADLINE_S
    while not cond():
        if any(p.poll() is not None for p in procs) or time.monotonic() > end:
            pytest.fail(f"{what}: " + " | ".join(log.read_text()[-2000:] for log in logs))
        time.sleep(0.05)


def _last_step(run_dir: Path) -> int:
    f = run_dir / "metrics.jsonl"
    lines = f.read_text().splitlines() if f.is_file() else []
    steps = [json.loads(line)["step"] for line in lines if line.strip().endswith("}")]
    return max(steps, default=0)


@pytest.mark.slow
def test_losing_one_of_two_agents_restarts_from_the_last_checkpoint(tmp_path):
    port, out = _free_port(), tmp_path / "job"
    logs = [tmp_path / "survivor.log", tmp_path / "lost.log"]
    survivor, lost = _agent(port, out, logs[0], host=True), _agent(port, out, logs[1], host=False)
    agents = [survivor, lost]
    try:
        _wait(lambda: any(s >= 2 * EVERY for s, _ in list_checkpoints(out)), agents, "no checkpoint", logs)
        assert _last_step(out) < STEPS, "the run ended before an agent could be lost"
        t_kill = time.monotonic()
        _kill_node(lost)
        # what the job had done when it lost the node: its newest complete checkpoint, its last logged step
        newest, reached = list_checkpoints(out)[-1][0], _last_step(out)
        survivor.wait(timeout=DEADLINE_S)
        took = time.monotonic() - t_kill
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_node(agent)
    assert survivor.returncode == 0, logs[0].read_text()[-4000:]
    ours = read_metrics(out)
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1))
    # a step's peak memory lists every rank: the steps kept from the two-node world, then the one-node world's
    worlds = [len(r["peak_mem_bytes"]) for r in ours]
    resumed = worlds.count(2)
    assert worlds == [2] * resumed + [1] * (STEPS - resumed), worlds
    assert resumed == newest and 0 <= reached - resumed <= EVERY, (resumed, newest, reached)
    print(f"\nnode lost after step {reached}; restarted from the step-{resumed} checkpoint on 1 process: "
          f"{reached - resumed} steps redone (checkpoint every {EVERY}); restart and the remaining "
          f"{STEPS - resumed} steps took {took:.1f} s")

    ref = tmp_path / "ref"
    subprocess.run([sys.executable, "-m", "prunus.cli.main", "train", *ARGS, "--out", str(ref)],
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, timeout=DEADLINE_S, capture_output=True)
    theirs = read_metrics(ref)
    for a, b in zip(ours[resumed:], theirs[resumed:]):
        assert abs(a["loss"] - b["loss"]) <= TOLERANCE, (a["step"], a["loss"], b["loss"])


def test_print_slurm_runs_one_elastic_agent_per_node():
    r = CliRunner().invoke(cli, ["train", "--preset", "tiny", "--nnodes", "1:4", "--max-restarts", "2", "--print-slurm",
                                 "--gpus-per-node", "2", "--out", "runs/e"])
    assert r.exit_code == 0, r.output
    assert "#SBATCH --nodes=4" in r.output and "#SBATCH --ntasks-per-node=1" in r.output
    line = r.output.splitlines()[-1]
    assert line.startswith("srun --ntasks-per-node=1 torchrun --nnodes 1:4 --nproc-per-node=2 --rdzv-backend c10d")
    assert "--max-restarts 2" in line and line.endswith("-m prunus.cli.main train --out runs/e --preset tiny")


@pytest.mark.parametrize("args, needle", [
    (["--nnodes", "1:2", "--tp", "2", "--dry-run"], "on 1 host(s) x --nproc 1"),  # tp above the smallest world
    (["--nnodes", "3:1", "--rdzv-endpoint", "127.0.0.1:29400"], "--nnodes '3:1': give MIN:MAX"),
    (["--nnodes", "1:2"], "--nnodes needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "1:2", "--rdzv-endpoint", "nohost"], "--rdzv-endpoint 'nohost': give HOST:PORT"),
])
def test_elastic_settings_are_refused_in_one_line(args, needle, assert_user_error):
    assert_user_error(CliRunner().invoke(cli, ["train", "--preset", "tiny", *args]), needle)


def test_dry_run_plans_the_largest_world():
    r = CliRunner().invoke(cli, ["train", "--preset", "tiny", "--nnodes", "1:2", "--nproc", "2", "--dry-run"])
    assert r.exit_code == 0 and "rank 0 of 4 ranks" in r.output, r.output
