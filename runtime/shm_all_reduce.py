"""An all-reduce through shared memory for tensor-parallel workers on one CPU host.

Why not gloo: a decode step of tensor-parallel serving makes two all-reduces per block
of a few kilobytes each, so latency is all that counts, and on these machines a gloo
all-reduce of one small activation over loopback took milliseconds, many times a pipe round
trip between two processes. Here each rank copies its tensor into its own slot
of a shared file, raises its flag, waits for every rank's flag, and sums the slots in
rank order, so every rank holds bit-identical sums. Two sets of slots alternate, so a
rank that is one all-reduce ahead never overwrites a slot another rank still reads;
tensors larger than a slot go through in chunks.

Ordering: the data is written before the flag, and read after it. x86-64 keeps stores
in program order as seen by other cores (and loads likewise), which is what this
relies on; :func:`supported` says no elsewhere and the workers keep gloo there.
A rank that waits notices a peer that died (its pid is in the file) and raises, so a
crashed worker never leaves the others spinning.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from prunus.artifacts.pids import pid_alive

SLOT_FLOATS = 1 << 20  # 4 MiB per slot; larger tensors go through in chunks
HEADER = 64  # int64 words: pids, then two flag rows
SPIN_BEFORE_YIELD = 200
CHECK_PEERS_EVERY_S = 0.5


def supported(device: str) -> bool:
    return device == "cpu" and platform.machine().lower() in ("x86_64", "amd64") and Path("/dev/shm").is_dir()


def shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


def _size(world: int, slot_floats: int) -> int:
    return HEADER * 8 + 2 * world * slot_floats * 4


class ShmAllReduce:
    """``all_reduce(t)`` sums ``t`` over ``world`` ranks in place. One process calls :meth:`create`
    before any rank opens ``path`` (the caller orders that, e.g. with a barrier)."""

    @staticmethod
    def create(path: str | Path, world: int, slot_floats: int = SLOT_FLOATS) -> None:
        if world * 3 > HEADER:
            raise ValueError(f"shared-memory all-reduce supports up to {HEADER // 3} ranks")
        with open(path, "wb") as f:
            f.truncate(_size(world, slot_floats))

    def __init__(self, path: str | Path, rank: int, world: int, slot_floats: int = SLOT_FLOATS):
        self.rank, self.world, self.slot = rank, world, slot_floats
        size = _size(world, slot_floats)
        with open(path, "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), size)
        header = np.frombuffer(self._mm, dtype=np.int64, count=HEADER)
        self._pids = header[:world]
        self._flags = header[world:3 * world].reshape(2, world)
        data = torch.frombuffer(self._mm, dtype=torch.float32, offset=HEADER * 8, count=2 * world * slot_floats)
        self._slots = data.view(2, world, slot_floats)
        self._pids[rank] = os.getpid()
        self._seq = 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(tensor)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
        for start in range(0, flat.numel(), self.slot):
            chunk = flat[start:start + self.slot]
            self._seq += 1
            buf, n = self._seq % 2, chunk.numel()
            self._slots[buf, self.rank, :n].copy_(chunk)
            self._flags[buf, self.rank] = self._seq  # after the data: other cores see the two in this order
            self._wait(buf)
            chunk.copy_(self._slots[buf, :, :n].sum(0))
        if not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    def _wait(self, buf: int) -> None:
        flags, seq = self._flags[buf], self._seq
        spins, checked = 0, time.monotonic()
        while (flags < seq).any():
            spins += 1
            if spins >= SPIN_BEFORE_YIELD:
                os.sched_yield()
                now = time.monotonic()
                if now - checked > CHECK_PEERS_EVERY_S:
                    checked = now
                    self._check_peers()

    def _check_peers(self) -> None:
        for r, pid in enumerate(self._pids.tolist()):
            if r != self.rank and pid and not pid_alive(pid):
                raise RuntimeError(f"tensor-parallel rank {r} (pid {pid}) exited during an all-reduce")

    def close(self) -> None:
        self._slots = self._flags = self._pids = None
        try:
            self._mm.close()
        except BufferError:  # a view still alive; the mapping goes with the process
            pass
