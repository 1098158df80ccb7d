"""One tensor-parallel worker process: its shard of the model, answering the serving process's steps.

Started by :class:`prunus.runtime.torch_tp.TPBackend`, one per rank::

    python -m prunus.runtime.tp_worker ADDRESS RANK WORLD STORE SPEC_JSON

It connects back to the serving process over a local socket (``ADDRESS``, authenticated with
the key in ``PRUNUS_TP_AUTHKEY``), joins the process group (``STORE``: a file rendezvous; NCCL
on GPU, gloo on a CPU host with the shared-memory all-reduce of
:mod:`prunus.runtime.shm_all_reduce`), loads and shards the model (:mod:`prunus.runtime.tp_shard`),
says ``ready``, then runs every step it receives: ``(op, rows, data)`` with ``op`` one of
``OP_PREFILL`` / ``OP_DECODE`` / ``OP_STOP``. Rank 0 answers with the logits (or one error line).

No orphans: a worker ignores Ctrl-C (the serving process closes it), exits on ``OP_STOP``, and
exits when the serving process dies: it waits on its connection and leaves on its end-of-file;
on Linux the kernel also kills it with its parent (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from multiprocessing.connection import Client

import torch

from prunus.artifacts.errors import PrunusError

OP_STOP, OP_PREFILL, OP_DECODE = 0, 1, 2  # the first item of every step the serving process sends


def _die_with_parent() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the serving process, which closes us
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def worker_main(address: str, rank: int, world: int, store: str, spec: dict) -> None:
    _die_with_parent()
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
            os._exit(0)  # the serving process is gone
        if op == OP_STOP:
            break
        try:
            out = backend.prefill(rows, data) if op == OP_PREFILL else backend.decode(rows, data)
            reply = ("ok", out.cpu().numpy())  # numpy: a torch tensor would travel as a shared-memory handle
        except PrunusError as e:  # raised the same way on every rank, before any collective
            reply = ("error", str(e))
        if rank == 0:
            conn.send(reply)
    if all_reduce is not None:
        all_reduce.close()
    dist.destroy_process_group()
    conn.close()


if __name__ == "__main__":
    worker_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]))
