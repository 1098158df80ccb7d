"""The run dir: ``run.json`` (the resolved settings), ``metrics.jsonl``, ``checkpoints/``, ``loss.png`` and ``model/``.

Checks happen before anything is written: a dir holding another run is refused
unless overwriting; resuming needs a checkpoint and the same run-defining settings.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from prunus.models.atomic import atomic_write_json
from prunus.models.errors import PrunusError

from .checkpoint import list_checkpoints
from .config import RESUMABLE, TrainConfig

RUN_CONFIG = "run.json"


def read_run_config(run_dir: str | Path) -> TrainConfig:
    path = Path(run_dir) / RUN_CONFIG
    if not path.is_file():
        raise PrunusError(f"--resume: {run_dir} holds no run ({RUN_CONFIG} missing) and so no checkpoint; start a new run without --resume")
    return TrainConfig.from_dict(json.loads(path.read_text())["train"])


def resume_config(run_dir: str | Path, **overrides) -> TrainConfig:
    """The saved settings of the run in ``run_dir``, with ``overrides`` applied."""
    saved = read_run_config(run_dir).to_dict()
    saved["stop_at"] = None  # an early stop belongs to the invocation that asked for it
    saved.update(overrides, out=str(run_dir))
    return TrainConfig.from_dict(saved)


def check_run_dir(cfg: TrainConfig, *, resume: bool, overwrite: bool) -> Path | None:
    """Validate the run dir for this invocation; return the checkpoint to resume from, if any."""
    out = Path(cfg.out)
    if resume:
        saved = read_run_config(out)
        ckpts = list_checkpoints(out)
        if not ckpts:
            raise PrunusError(f"--resume: no checkpoint in {out / 'checkpoints'}; start a new run without --resume")
        differ = [k for k, v in saved.to_dict().items() if k not in RESUMABLE and k != "out" and cfg.to_dict()[k] != v]
        if differ:
            k = differ[0]
            raise PrunusError(f"--resume: {k} is {cfg.to_dict()[k]!r} but the run in {out} used {saved.to_dict()[k]!r}; keep it or start a new run with another --out")
        return ckpts[-1][1]
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise PrunusError(f"{out}: already holds a run or other files; pass --resume to continue it, --overwrite to replace it, or choose another --out")
    return None


def init_run_dir(cfg: TrainConfig, *, overwrite: bool, extra: dict) -> Path:
    out = Path(cfg.out)
    if overwrite and out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / RUN_CONFIG, {"train": cfg.to_dict(), **extra})
    return out
