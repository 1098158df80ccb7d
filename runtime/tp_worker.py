"""One tensor-parallel worker process: its shard of the model, answering the serving process's steps.

Started by :class:`prunus.runtime.torch_tp.TPBackend`, one per rank::

    python -m prunus.runtime.tp_worker ADDRESS RANK WORLD STORE SPEC_JSON

It connects back to the serving process over a local socket (``ADDRESS``, authenticated with
the key in ``PRUNUS_TP_AUTHKEY``), joins the process group (``STORE``: a file rendezvous; NCCL
on GPU, gloo on a CPU host with the shared-memory all-reduce of
:mod:`prunus.runtime.shm_all_reduce`), loads and shards the model (:mod:`prunus.runtime.tp_shard`),
says ``ready``, then runs every step it receives: ``(op, rows, data)`` with ``op`` one of
``OP_PREFILL`` / ``OP_DECODE`` / ``OP_STOP``. Rank 0 answers with the logits (or one error line).

No orphans, nothing left behind: a worker ignores Ctrl-C and SIGTERM while the serving process runs (that
process stops it once its requests are done, even when a signal reached the whole process group), exits on
``OP_STOP``, and exits when the serving process dies, however it died (SIGKILL included): the kernel tells it
(``PR_SET_PDEATHSIG`` on Linux), a thread of its own checks its parent every :data:`WATCH_EVERY_S`, and the end of
its connection says so too. A worker that finds the serving process gone first removes the temp dir and
shared-memory file that process could not (``SPEC_JSON``'s ``owned``, named ``prunus-tp-PID-...`` after it,
:func:`prunus.artifacts.pids.remove_orphaned`: never while that PID runs); the other workers are leaving too.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Client

import torch

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.pids import pid_alive, remove_orphaned

OP_STOP, OP_PREFILL, OP_DECODE = 0, 1, 2  # the first item of every step the serving process sends
TEMP_PREFIX = "prunus-tp-"  # the serving process's socket dir and shared-memory file: prunus-tp-PID-...
WATCH_EVERY_S = 0.2  # how often a worker checks that the serving process still runs
EXIT_WAIT_S = 2.0  # how long a worker that lost its connection waits for the serving process's exit to complete


def _owner_gone(owner: int, parent: int) -> bool:
    """The serving process ``owner`` is gone, or going: this worker was handed to another parent (the kernel does
    that as its parent exits), or ``owner`` no longer runs (a worker started through a wrapper: ``parent`` is
    the wrapper)."""
    return (parent == owner and os.getppid() != owner) or not pid_alive(owner)


def _leave(owner: int, owned: list[str]) -> None:
    """Exit; once ``owner``'s exit is complete (it no longer runs), remove the temp names it left first."""
    deadline = time.monotonic() + EXIT_WAIT_S
    while pid_alive(owner) and time.monotonic() < deadline:
        time.sleep(0.01)
    remove_orphaned(owned, TEMP_PREFIX)  # removes nothing of a process that still runs
    os._exit(0)


def _watch_owner(owner: int, owned: list[str]) -> None:
    """Leave with the serving process (see the module docstring)."""
    parent = os.getppid()

    def gone_then_leave(*_) -> None:
        if _owner_gone(owner, parent):
            _leave(owner, owned)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the serving process, which closes us
    signal.signal(signal.SIGTERM, gone_then_leave)  # so does a SIGTERM to the process group
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass

    def poll() -> None:  # also where the signal cannot run: the main thread inside a long C call
        while True:
            gone_then_leave()
            time.sleep(WATCH_EVERY_S)
    threading.Thread(target=poll, name="prunus-tp-owner", daemon=True).start()


def worker_main(address: str, rank: int, world: int, store: str, spec: dict) -> None:
    owner, owned = spec.get("owner", os.getppid()), spec.get("owned", [])
    _watch_owner(owner, owned)
    import torch.distributed as dist

    from prunus.models import load_model

    from .torch import TorchBackend
    from .shm_all_reduce import ShmAllReduce
    from .tp_shard import shard_model

    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ["PRUNUS_TP_AUTHKEY"]))
    conn.send(("hello", rank, None))
    try:
        device = spec["device"]
        if device.startswith("cuda"):
            device = f"cuda:{rank}"
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method=f"file://{store}",
                                rank=rank, world_size=world)
        all_reduce = None
        if spec["shm"]:
            if rank == 0:
                ShmAllReduce.create(spec["shm"], world)  # before any rank opens it
            dist.barrier()
            all_reduce = ShmAllReduce(spec["shm"], rank, world)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(spec["dtype"])
        model = load_model(spec["path"], device=device, dtype=dtype)
        shard_model(model, rank, world, keep_output=rank == 0, all_reduce=all_reduce)
        backend = TorchBackend(model, spec["n_slots"], spec["max_len"])
        dist.barrier()
        if spec["shm"] and rank == 0:
            os.unlink(spec["shm"])  # every rank has it mapped: the memory lives on, and no crash can leak the file
    except Exception as e:  # the serving process shows it as one line
        conn.send(("error", rank, f"rank {rank}: {type(e).__name__}: {e}"))
        os._exit(1)
    conn.send(("ready", rank, None))
    while True:
        try:
            op, rows, data = conn.recv()  # every rank gets the same step from the serving process
        except (EOFError, OSError):
            _leave(owner, owned)  # the serving process is gone, or going
        if op == OP_STOP:
            break
        try:
            out = backend.prefill(rows, data) if op == OP_PREFILL else backend.decode(rows, data)
            reply = ("ok", out.cpu().numpy())  # numpy: a torch tensor would travel as a shared-memory handle
        except PrunusError as e:  # raised the same way on every rank, before any collective
            reply = ("error", str(e))
        if rank == 0:
            try:
                conn.send(reply)
            except OSError:  # the serving process is gone, or going
                _leave(owner, owned)
    if all_reduce is not None:
        all_reduce.close()
    dist.destroy_process_group()
    conn.close()


if __name__ == "__main__":
    worker_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]))
