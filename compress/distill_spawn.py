"""Distillation on ``nproc`` local processes when none were launched: the spawner and each rank's entry point.

``distill(..., nproc=N)`` outside a process group writes the teacher, the student (model dirs),
the engine's config and the loss arguments to a work dir as ``spec.json``; :func:`spawn` runs
``torchrun --standalone --nproc-per-node=N -m prunus.compress.distill_spawn spec.json``, whose
ranks (:func:`run_spec`) train the student with the parallel engine and rank 0 writes the
losses and metrics to ``result.json``; the consolidated student is read back from the run dir.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, load_model, save_model
from prunus.train_parallel import TrainConfig, train
from prunus.train_parallel.launch.launch import run_module_ranks

from .distill_loss import DistillObjective


def spawn(ctx, student: Transformer, cfg: TrainConfig, work: Path, loss_args: dict, channels,
          nproc: int) -> tuple[Transformer, list[float], dict]:
    """Train ``student`` on ``nproc`` local processes (torchrun) in ``work``; return (the consolidated
    student, the loss of every step, the engine's last metrics)."""
    save_model(ctx.teacher, work / "teacher", tokenizer=ctx.tokenizer, stage="distill-teacher")
    save_model(student, work / "student", tokenizer=ctx.tokenizer, stage="distill-student")
    spec = {"teacher": str(work / "teacher"), "student": str(work / "student"), "config": cfg.to_dict(),
            "loss": loss_args, "channels": channels.tolist() if channels is not None else None,
            "result": str(work / "result.json")}
    (work / "spec.json").write_text(json.dumps(spec))
    rc = run_module_ranks(nproc, "prunus.compress.distill_spawn", [str(work / "spec.json")])
    if rc != 0 or not (work / "result.json").is_file():
        raise PrunusError(f"distill: the {nproc}-process run failed (exit code {rc}); its output above says why")
    out = json.loads((work / "result.json").read_text())
    model = load_model(Path(cfg.out) / "model", device=ctx.device)
    return model, out["losses"], out["metrics"]


def run_spec(spec_path: str) -> None:
    """One rank of a spawned distillation run (``python -m prunus.compress.distill_spawn SPEC`` under torchrun)."""
    spec = json.loads(Path(spec_path).read_text())
    teacher = load_model(spec["teacher"])
    student = load_model(spec["student"]).train()
    channels = torch.tensor(spec["channels"]) if spec["channels"] is not None else None
    objective = DistillObjective(teacher, student, channels=channels, **spec["loss"])
    r = train(TrainConfig.from_dict(spec["config"]), model=student, objective=objective)
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(spec["result"]).write_text(json.dumps({"losses": r.losses, "metrics": r.metrics}))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    run_spec(sys.argv[1])
