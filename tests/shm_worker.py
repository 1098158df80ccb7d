"""One rank of the shared-memory all-reduce check in tests/test_serve.py.

    python tests/shm_worker.py PATH RANK WORLD OUT

Reduces a few tensors (one larger than a slot, one not contiguous, one bfloat16), saves
them to OUT, then (rank WORLD-1 having left) tries one more and records the error.
"""

import sys

import torch

from prunus.runtime.shm_all_reduce import ShmAllReduce

SLOT = 1000  # floats: small, so the 2,500-float tensor goes through in three chunks


def tensors(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return {"small": torch.randn(1, 1, 16, generator=g), "chunked": torch.randn(2, 1250, generator=g),
            "strided": torch.randn(8, 6, generator=g).t(), "bf16": torch.randn(4, 64, generator=g).bfloat16()}


if __name__ == "__main__":
    path, rank, world, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    reduce = ShmAllReduce(path, rank, world, slot_floats=SLOT)
    result = {}
    for name, t in tensors(rank).items():
        for _ in range(3):  # repeated calls cycle through both buffers
            x = t.clone()
            reduce(x)
        result[name] = x
    if rank == world - 1:
        torch.save(result, out)
        sys.exit(0)
    try:
        reduce(torch.ones(4))  # the last rank has left: the others must not wait forever
        result["after_exit"] = "returned"
    except RuntimeError as e:
        result["after_exit"] = str(e)
    torch.save(result, out)
