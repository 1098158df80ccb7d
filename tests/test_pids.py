"""pid_alive, the one liveness check behind stale temp names and the shared-memory all-reduce's peers."""

from __future__ import annotations

import os
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
