"""Each rank's entry of EAGLE draft training on ``nproc`` local processes.

``train_eagle(..., nproc=N)`` outside a process group writes its arguments to a work dir as ``spec.json`` and runs
``torchrun --standalone --nproc-per-node=N -m prunus.compress.eagle_spawn spec.json``
(:func:`prunus.compress.eagle_draft.spawn`); every rank (:func:`run_spec`) calls ``train_eagle`` inside the group
(each its share of every batch, gradients averaged), rank 0 writes the draft dir and its figures to ``result.json``,
which the caller returns.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from prunus.artifacts.errors import PrunusError


def run_spec(spec_path: str) -> None:
    """One rank of a spawned run (``python -m prunus.compress.eagle_spawn SPEC`` under torchrun)."""
    import torch.distributed as dist

    from .eagle_draft import group, train_eagle

    spec = json.loads(Path(spec_path).read_text())
    figures = train_eagle(spec["target"], spec["out"], **spec["keywords"], log=print if spec["progress"] else None)
    if group()[0] == 0:
        Path(spec["result"]).write_text(json.dumps(figures))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        run_spec(sys.argv[1])
    except PrunusError as e:
        sys.exit(f"prunus: {e}")
