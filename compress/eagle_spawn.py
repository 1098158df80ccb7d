"""EAGLE draft training on ``nproc`` local processes when none were launched: the spawner and each rank's entry.

``train_eagle(..., nproc=N)`` outside a process group writes its arguments to a work dir as ``spec.json`` and runs
``torchrun --standalone --nproc-per-node=N -m prunus.compress.eagle_spawn spec.json``; every rank
(:func:`run_spec`) calls ``train_eagle`` inside the group (each its share of every batch, gradients averaged), rank
0 writes the draft dir and its figures to ``result.json``, which the caller returns.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from prunus.artifacts.errors import PrunusError


def spawn(target_dir: str, out: str, keywords: dict, nproc: int) -> dict:
    """The figures of a run of ``train_eagle(target_dir, out, **keywords)`` on ``nproc`` local processes."""
    from prunus.train_parallel.launch.launch import run_module_ranks

    with tempfile.TemporaryDirectory(prefix="prunus-eagle-") as work:
        spec, result = Path(work) / "spec.json", Path(work) / "result.json"
        spec.write_text(json.dumps({"target": target_dir, "out": out, "keywords": keywords, "result": str(result)}))
        rc = run_module_ranks(nproc, "prunus.compress.eagle_spawn", [str(spec)])
        if rc != 0 or not result.is_file():
            raise PrunusError(f"eagle: the {nproc}-process run failed (exit code {rc}); its output above says why")
        return json.loads(result.read_text())


def run_spec(spec_path: str) -> None:
    """One rank of a spawned run (``python -m prunus.compress.eagle_spawn SPEC`` under torchrun)."""
    import torch.distributed as dist

    from .eagle_draft import group, train_eagle

    spec = json.loads(Path(spec_path).read_text())
    figures = train_eagle(spec["target"], spec["out"], **spec["keywords"])
    if group()[0] == 0:
        Path(spec["result"]).write_text(json.dumps(figures))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        run_spec(sys.argv[1])
    except PrunusError as e:
        sys.exit(f"prunus: {e}")
