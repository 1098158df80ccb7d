"""The run dir of a generic module's training run: the transformer's layout and rules (:mod:`.run_dir`).

Checked before anything is written: a dir holding another run is refused unless overwriting (then the new
run is written beside it and replaces it only once complete); a resumed run needs a checkpoint and the same
run-defining settings (:data:`.module_config.MODULE_RESUMABLE` may change). ``run.json`` holds
``{"kind": "module", "train": settings}``. A failed invocation leaves nothing half-written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from prunus.artifacts.atomic import disk_error, writable_parent
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.paths import check_output, check_replaceable
from prunus.artifacts.validate import read_json_object, short

from .checkpoint.checkpoint import list_checkpoints
from .module_config import MODULE_RESUMABLE, ModuleTrainConfig
from .run_dir import RUN_CONFIG, discard_incomplete_run, init_run_dir, newest_intact, prior_state, run_location


@dataclass
class ModuleRun:
    path: Path  # the dir this invocation writes (OUT, or the staging dir of an overwriting run)
    resume_from: Path | None
    resume: bool
    overwrite: bool
    prior: str | None = None  # what the dir was before rank 0 first wrote to it (run_dir.prior_state)


def _occupied(path: Path) -> bool:
    return os.path.lexists(path) and (not path.is_dir() or path.is_symlink() or any(path.iterdir()))


def _saved_settings(work: Path) -> ModuleTrainConfig:
    path = work / RUN_CONFIG
    if not path.is_file():
        raise PrunusError(f"--resume: {work} holds no run ({RUN_CONFIG} missing); start a new run without --resume")
    run = read_json_object(path, fix="start a new run with --overwrite")
    if run.get("kind") != "module" or not isinstance(run.get("train"), dict):
        raise PrunusError(f"{path}: not a generic module's run (resume a transformer run without --model)")
    return ModuleTrainConfig.from_dict(run["train"], source=str(path))


def _check_resume(cfg: ModuleTrainConfig, work: Path) -> Path:
    saved = _saved_settings(work).to_dict()
    mine = cfg.to_dict()
    differ = [k for k, v in saved.items() if k not in MODULE_RESUMABLE and k != "out" and mine[k] != v]
    if differ:
        k = differ[0]
        raise PrunusError(f"--resume: {k} is {short(mine[k])} but the run in {cfg.out} used {short(saved[k])}; keep it "
                          "or start a new run in another --out")
    ckpts = list_checkpoints(work)
    if not ckpts:
        raise PrunusError(f"--resume: no checkpoint in {work / 'checkpoints'}; start a new run without --resume")
    return newest_intact(ckpts, work)


def check_module_run(cfg: ModuleTrainConfig, *, resume: bool, overwrite: bool) -> ModuleRun:
    """Where this invocation writes, and the checkpoint it resumes from (if any); one line for a dir it may not use."""
    out = Path(cfg.out)
    check_output(out, [("--data", cfg.data)])
    work, resume, overwrite = run_location(cfg, resume=resume, overwrite=overwrite)
    if resume:
        return ModuleRun(work, _check_resume(cfg, work), resume, overwrite)
    if _occupied(out) and not overwrite:
        raise PrunusError(f"{out}: already holds a run or other files; pass --resume to continue it, --overwrite to "
                          "replace it, or choose another --out")
    if overwrite:
        check_replaceable(out)
    writable_parent(out)
    return ModuleRun(work, None, resume, overwrite)


def open_module_run(run: ModuleRun, cfg: ModuleTrainConfig) -> None:
    """Create the run dir and its run.json (rank 0)."""
    run.prior = prior_state(run.path, cfg)
    init_run_dir(cfg, overwrite=run.overwrite and not run.resume, extra={"kind": "module"}, run_dir=run.path)


def discard_on_failure(run: ModuleRun, cfg: ModuleTrainConfig, error: BaseException) -> None:
    """After a failure (rank 0): remove what this invocation wrote when nothing complete is left; a write the disk
    refused becomes one line saying what is left. Other errors propagate as they are."""
    if run.prior is None:
        return
    left = discard_incomplete_run(run.path, run.prior, cfg.out)
    reason = disk_error(error)
    if reason is not None:
        raise PrunusError(f"{cfg.out}: writing the run failed ({reason}); {left}") from None
