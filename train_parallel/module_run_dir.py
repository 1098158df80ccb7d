"""The run dir of a generic module's training run: the transformer's layout and rules (:mod:`.run_dir`).

Checked before anything is written: a dir holding another run is refused unless overwriting (then the new
run is written beside it and replaces it only once complete); a resumed run needs a checkpoint and the same
run-defining settings (:data:`.module_config.MODULE_RESUMABLE` may change). ``run.json`` holds
``{"kind": "module", "train": settings}``. A failed invocation leaves nothing half-written.

Beside the step checkpoints (the last ones, which ``--resume`` continues from), ``checkpoints/best/`` holds the
weights of the step whose held-out figure was best so far (``val_accuracy``, highest, for a classifier; else
``val_loss``, lowest) and ``best.json`` (``step``, ``metric``, ``value``, the step's ``figures``, the weights'
``sha256``), each file
written atomically, the record last.
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


def is_module_run(path: str | Path) -> bool:
    """Whether ``path`` holds a generic module's run (its run.json says ``"kind": "module"``)."""
    run_json = Path(path) / RUN_CONFIG
    if not run_json.is_file():
        return False
    try:
        return read_json_object(run_json, fix="re-create the run").get("kind") == "module"
    except PrunusError:
        return False


def saved_settings(work: str | Path) -> ModuleTrainConfig:
    """The settings the generic module's run in ``work`` recorded in its run.json; one line when it has none."""
    path = Path(work) / RUN_CONFIG
    if not path.is_file():
        raise PrunusError(f"--resume: {work} holds no run ({RUN_CONFIG} missing); start a new run without --resume")
    run = read_json_object(path, fix="start a new run with --overwrite")
    if run.get("kind") != "module" or not isinstance(run.get("train"), dict):
        raise PrunusError(f"{path}: not a generic module's run (resume a transformer run without --model)")
    return ModuleTrainConfig.from_dict(run["train"], source=str(path))


def differing_setting(cfg: ModuleTrainConfig, saved: ModuleTrainConfig) -> str | None:
    """The first run-defining setting (not in MODULE_RESUMABLE) ``cfg`` changes from the ``saved`` run's."""
    mine, theirs = cfg.to_dict(), saved.to_dict()
    return next((k for k, v in theirs.items() if k not in MODULE_RESUMABLE and k != "out" and mine[k] != v), None)


def _check_resume(cfg: ModuleTrainConfig, work: Path) -> Path:
    saved = saved_settings(work)
    k = differing_setting(cfg, saved)
    if k is not None:
        flag = {"model": "--model", "model_args": "--model-args"}.get(k, "--" + k.replace("_", "-"))
        raise PrunusError(f"--resume: {flag} is {short(cfg.to_dict()[k])} but the run in {cfg.out} used "
                          f"{short(saved.to_dict()[k])}; drop it (the run's own is used) or start a new run in "
                          "another --out")
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


BEST_DIR, BEST_WEIGHTS, BEST_RECORD = "best", "model.safetensors", "best.json"


def best_figure(record: dict) -> tuple[str, float] | None:
    """(the metric, its value) that ranks an evaluated step: ``val_accuracy`` when scored, else ``val_loss``."""
    for key in ("val_accuracy", "val_loss"):
        if isinstance(record.get(key), (int, float)):
            return key, float(record[key])
    return None


def improves(figure: tuple[str, float], best: dict | None) -> bool:
    """Whether ``figure`` beats the ``best`` record (higher accuracy, lower loss; the first always does)."""
    if best is None or best.get("metric") != figure[0]:
        return True
    return figure[1] > best["value"] if figure[0] == "val_accuracy" else figure[1] < best["value"]


def save_best(run_dir: Path, step: int, figure: tuple[str, float], state: dict, figures: dict) -> dict:
    """The full state dict ``state`` written as the best checkpoint of ``run_dir`` (rank 0); returns its record."""
    import hashlib

    from safetensors.torch import save

    from prunus.artifacts.atomic import atomic_write_bytes, atomic_write_json

    best = Path(run_dir) / "checkpoints" / BEST_DIR
    best.mkdir(parents=True, exist_ok=True)
    data = save({k: v.detach().cpu().contiguous().clone() for k, v in state.items()})
    atomic_write_bytes(best / BEST_WEIGHTS, data)
    record = {"step": step, "metric": figure[0], "value": figure[1], "figures": figures,
              "sha256": hashlib.sha256(data).hexdigest()}
    atomic_write_json(best / BEST_RECORD, record)
    return record


def read_best(run_dir: str | Path) -> dict | None:
    """The best checkpoint's record in ``run_dir``, or None when there is none (or it is not a valid record)."""
    path = Path(run_dir) / "checkpoints" / BEST_DIR / BEST_RECORD
    if not path.is_file() or path.is_symlink():
        return None
    try:
        record = read_json_object(path, fix="remove it")
    except PrunusError:
        return None
    ok = (isinstance(record.get("step"), int) and record.get("metric") in ("val_accuracy", "val_loss")
          and isinstance(record.get("value"), (int, float)) and isinstance(record.get("sha256"), str))
    if ok and not isinstance(record.get("figures"), dict):
        record["figures"] = {}
    return record if ok else None


def load_best(run_dir: str | Path, record: dict) -> dict:
    """The best checkpoint's weights, checked against the hash its record holds."""
    import hashlib

    from safetensors.torch import load

    path = Path(run_dir) / "checkpoints" / BEST_DIR / BEST_WEIGHTS
    if not path.is_file() or path.is_symlink():
        raise PrunusError(f"{path}: missing; the best checkpoint is gone: write the model dir from the last "
                          "(--model-from last)")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise PrunusError(f"{path}: does not match its {BEST_RECORD} (damaged); write the model dir from the last "
                          "(--model-from last)")
    return load(data)
