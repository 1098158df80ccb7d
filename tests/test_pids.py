"""pid_alive, the one liveness check behind stale temp names and the shared-memory all-reduce's peers; the temp
names of dead processes removed, never a live one's; a tensor-parallel worker removing its killed server's dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prunus.artifacts.atomic import clean_stale_temps
from prunus.artifacts.pids import pid_alive


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="zombies are read from /proc (Linux)")
def test_a_zombie_counts_as_gone_and_its_temp_names_are_cleaned(tmp_path):
    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert pid_alive(child.pid)
        (tmp_path / f".model.tmp-{child.pid}").mkdir()
        assert clean_stale_temps(tmp_path) == []  # a running writer's temp stays
        child.stdin.close()  # the child exits; not reaped until wait(): a zombie meanwhile
        deadline = time.monotonic() + 30
        while pid_alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        assert not pid_alive(child.pid)
        assert clean_stale_temps(tmp_path) == [tmp_path / f".model.tmp-{child.pid}"]
    finally:
        child.wait()
    assert not pid_alive(child.pid)


def test_only_temp_names_of_dead_processes_are_removed(tmp_path):
    from prunus.artifacts.pids import remove_orphaned, remove_stale

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that ran and is gone
    live, dead, other = (tmp_path / f"prunus-tp-{os.getpid()}-a", tmp_path / f"prunus-tp-{child.pid}-b",
                         tmp_path / "prunus-tp-x-c")
    for d in (live, dead, other):
        d.mkdir()
    (dead / "sock").write_text("")
    (tmp_path / f"prunus-tp-{child.pid}-shm").write_bytes(b"\0" * 64)
    assert remove_orphaned([live, other], "prunus-tp-") == []
    assert sorted(remove_stale(tmp_path, "prunus-tp-")) == [dead, tmp_path / f"prunus-tp-{child.pid}-shm"]
    assert live.is_dir() and other.is_dir() and not dead.exists()


OWNER = """
import os, subprocess, sys, tempfile, time
owned = tempfile.mkdtemp(prefix=f"prunus-tp-{os.getpid()}-", dir=sys.argv[2])
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), owned], stdout=subprocess.PIPE,
                          text=True)
assert worker.stdout.readline().strip() == "ready"
print(worker.pid, owned, flush=True)
time.sleep(120)
"""
WORKER = """
import sys, time
from prunus.runtime.tp_worker import _watch_owner
_watch_owner(int(sys.argv[1]), [sys.argv[2]])
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.slow  # starts processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="zombies and process parents are read from /proc")
def test_a_tensor_parallel_worker_removes_the_temp_dir_of_its_killed_server(tmp_path):
    """SIGTERM leaves a worker to its serving process; SIGKILL of that process takes the worker and its dir."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, WORKER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        pid, owned = owner.stdout.readline().split()
        worker, owned = int(pid), Path(owned)
        os.kill(worker, signal.SIGTERM)  # the serving process's to handle: the worker stays
        time.sleep(0.5)
        assert pid_alive(worker) and owned.is_dir()
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while (owned.exists() or pid_alive(worker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not owned.exists() and not pid_alive(worker)
    finally:
        owner.kill()
