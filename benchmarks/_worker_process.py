"""A benchmark contender in a process of its own, driven by one JSON line per request.

The parent side (:class:`WorkerProcess`) writes ``{"op": ..., ...}`` to the worker's stdin and reads
one JSON answer from its stdout; the worker side (:func:`serve`) answers each op with its handler,
or ``{"error": "..."}`` when the handler raises, until ``{"op": "quit"}`` or end of input. The
worker's stderr goes to a temporary log whose last lines explain a worker that died.

Only the standard library: the llama.cpp worker runs in an interpreter of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from typing import Callable


class WorkerProcess:
    def __init__(self, argv: list[str], what: str, env: dict[str, str] | None = None):
        self.what = what
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-worker-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)

    def call(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            tail = "".join(self.log.readlines()[-5:])
            raise RuntimeError(f"the {self.what} worker exited (code {self.proc.wait()}); its stderr ends:\n{tail}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{self.what} worker, {request['op']}: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(handlers: dict[str, Callable[..., dict]], inp, out) -> None:
    """Answer requests from ``inp`` on ``out``: ``handlers[op](**the other fields)``."""
    for line in inp:
        req = json.loads(line)
        op = req.pop("op", None)
        if op == "quit":
            break
        try:
            ans = handlers[op](**req) if op in handlers else {"error": f"unknown op {op!r}"}
        except Exception as e:  # answered, so the benchmark can say what failed
            ans = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(ans) + "\n")
        out.flush()
