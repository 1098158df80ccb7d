"""The tensor-parallel backend: the serving process's side of ``tp`` worker processes
(:mod:`prunus.runtime.tp_worker`) over torch.distributed (NCCL on GPU; on a CPU host, gloo
for setup and a shared-memory all-reduce).

The serving process keeps the scheduler and holds a local socket to every worker:
each step it sends (rows, tokens) to all of them, every rank runs the same
:class:`TorchBackend` pass over its shard (two all-reduces per block,
:mod:`prunus.runtime.tp_shard`), and rank 0 answers with the logits. The scheduler
samples, so rank 0 holds the only logits and the tokens every rank sees next step come
from that one place. On a CPU host the all-reduces go through shared memory
(:mod:`prunus.runtime.shm_all_reduce`; gloo's took milliseconds each), on GPUs through NCCL.

No orphans, no leftovers: :meth:`TPBackend.close` stops the workers (a stop step), waits for them, kills any
that linger and removes the temp dir (socket, rendezvous file); the workers themselves leave when this process
dies, SIGKILL included, and the first to notice removes that dir and the shared-memory file
(:mod:`prunus.runtime.tp_worker`). Both are named after this process's pid (``prunus-tp-PID-...``), so what
survives even that (the whole group killed at once) goes at the next start here, and never while PID runs.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Listener
from pathlib import Path

import torch

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.pids import pid_prefix, remove_stale
from prunus.models.model_dir import read_config

from .backend import BackendBase, Capabilities
from .load_options import LoadOptions
from .registry import Loaded
from .shm_all_reduce import shm_dir
from .shm_all_reduce import supported as shm_supported
from .tp_shard import check_tp
from .tp_worker import OP_DECODE, OP_PREFILL, OP_STOP, TEMP_PREFIX

READY_TIMEOUT_S = 300.0


class TPBackend(BackendBase):
    """The serving process's side: the same prefill/decode calls as :class:`TorchBackend`."""

    name = "torch"

    def __init__(self, path: str | Path, tp: int, *, n_slots: int, max_len: int, device: str = "cpu",
                 dtype: str | None = None):
        cfg, _ = read_config(path)
        check_tp(cfg, tp, source=str(path))
        if device.startswith("cuda") and (not torch.cuda.is_available() or torch.cuda.device_count() < tp):
            raise PrunusError(f"tp={tp} on {device} needs {tp} CUDA devices; found "
                              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
        self.tp, self.n_slots, self.max_len, self.vocab_size = tp, n_slots, max_len, cfg.vocab_size
        self.procs: list[subprocess.Popen] = []
        self.conns = []
        self._lock = threading.Lock()
        for parent in {Path(tempfile.gettempdir()), shm_dir()}:  # what a killed server left (its pid is in the name)
            remove_stale(parent, TEMP_PREFIX)
        self._tmp = Path(tempfile.mkdtemp(prefix=pid_prefix(TEMP_PREFIX)))
        authkey = secrets.token_bytes(16)
        self._listener = Listener(str(self._tmp / "sock"), family="AF_UNIX", authkey=authkey)
        shm = str(shm_dir() / f"{pid_prefix(TEMP_PREFIX)}{secrets.token_hex(4)}") if shm_supported(device) else None
        self._shm = shm
        spec = json.dumps({"path": str(Path(path).resolve()), "n_slots": n_slots, "max_len": max_len,
                           "device": device, "dtype": dtype, "shm": shm, "owner": os.getpid(),
                           "owned": [str(self._tmp)] + ([shm] if shm else [])})
        env = {**os.environ, "PRUNUS_TP_AUTHKEY": authkey.hex()}
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // tp))
        atexit.register(self.close)
        try:
            for rank in range(tp):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "prunus.runtime.tp_worker", str(self._tmp / "sock"), str(rank), str(tp),
                     str(self._tmp / "store"), spec],
                    env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno() if _has_fileno() else None,
                    start_new_session=False))
            self._accept_all()
        except BaseException:
            self.close()
            raise

    def _accept_all(self) -> None:
        conns: dict[int, object] = {}
        errors: list[str] = []

        def accept():
            try:
                pending = []
                while len(pending) < self.tp:  # every worker says hello as soon as it connects
                    conn = self._listener.accept()
                    pending.append((conn.recv()[1], conn))
                for rank, conn in sorted(pending, key=lambda rc: rc[0]):
                    kind, _, detail = conn.recv()
                    if kind == "error":
                        errors.append(detail)
                        return
                    conns[rank] = conn
            except (OSError, EOFError):
                pass

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while t.is_alive() and time.monotonic() < deadline:
            t.join(0.1)
            dead = [p for p in self.procs if p.poll() is not None]
            if errors or (dead and t.is_alive()):
                break
        self.conns = [conns[r] for r in sorted(conns)]
        if errors:
            raise PrunusError(f"tensor-parallel worker failed to load: {errors[0]}")
        if len(self.conns) < self.tp:
            raise PrunusError(f"tensor-parallel workers did not start ({len(self.conns)} of {self.tp} ready); "
                              "see their messages above")

    def _call(self, message) -> torch.Tensor:
        with self._lock:
            try:
                for conn in self.conns:
                    conn.send(message)
                kind, payload = self.conns[0].recv()
            except (EOFError, OSError, IndexError):
                raise PrunusError("a tensor-parallel worker exited; see its messages above and load the engine again") from None
        if kind == "error":
            raise PrunusError(payload)
        return torch.from_numpy(payload)

    def prefill(self, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        return self._call((OP_PREFILL, rows, prompts))

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        return self._call((OP_DECODE, rows, tokens))

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(max_batch=self.n_slots)

    def release(self, row: int) -> None:
        """Nothing to send: every rank's next prefill of the row starts it afresh."""

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self, timeout: float = 10.0) -> None:
        atexit.unregister(self.close)
        if self.conns:
            try:
                with self._lock:
                    for conn in self.conns:
                        conn.send((OP_STOP, [], []))
            except (OSError, EOFError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for c in self.conns:
            c.close()
        self.conns, self.procs = [], []
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        shutil.rmtree(self._tmp, ignore_errors=True)
        if self._shm:
            Path(self._shm).unlink(missing_ok=True)


def load(path: Path, config: dict, options: LoadOptions) -> Loaded:
    """A model dir sharded over ``options.tp`` worker processes."""
    from prunus.models import load_model_tokenizer

    backend = TPBackend(path, options.tp, n_slots=options.max_batch, max_len=options.max_len, device=options.device,
                        dtype=options.dtype)
    return Loaded(backend, load_model_tokenizer(path))


def _has_fileno() -> bool:
    try:
        sys.stderr.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False
