"""The run dir: ``run.json`` (the resolved settings), ``metrics.jsonl``, ``checkpoints/``, ``loss.png`` and ``model/``.

Checks happen before anything is written: a dir holding another run is refused
unless overwriting; resuming needs a checkpoint and the same run-defining settings;
the run dir never is, contains or lies inside an input (the corpus, the tokenizer).

Overwriting keeps the old run until the new one is complete: the new run is written
into ``.OUT.tmp-overwrite`` beside it and renamed over ``OUT`` when this invocation
ends (finished, or stopped at ``--stop-at`` with a checkpoint). A crash or Ctrl-C
leaves the old run as it was.

An invocation that fails (a full disk, an error, Ctrl-C) leaves nothing half-written: when the dir it
wrote holds nothing complete (no intact checkpoint, no model dir), what it wrote is removed, the dir
too when this invocation created it (:func:`discard_incomplete_run`). A dir that held a run before
(``--resume``) and a complete checkpoint are never removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

from prunus.artifacts.atomic import atomic_write_json, clean_stale_temps, disk_error, replace_dir, writable_parent
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.paths import check_output, check_replaceable
from prunus.artifacts.validate import read_json_object, short

from prunus.models.spec import TRANSFORMER, get_spec

from .checkpoint.checkpoint import checkpoint_problem, list_checkpoints

RUN_CONFIG = "run.json"


def run_kind(run_dir: str | Path) -> str:
    """The model kind of the run in ``run_dir`` (its run.json's ``kind``; none: the transformer's), "" for no run."""
    path = Path(run_dir) / RUN_CONFIG
    try:
        kind = read_json_object(path, fix="re-create the run").get("kind", TRANSFORMER) if path.is_file() else ""
    except PrunusError:
        return ""
    return kind if isinstance(kind, str) else ""


def read_run_config(run_dir: str | Path, expect: type | None = None):
    """The settings the run in ``run_dir`` recorded, as its kind's settings dataclass (the model spec's); one line
    when there is no run, or (``expect``: a settings class) a run of another kind."""
    path = Path(run_dir) / RUN_CONFIG
    if not path.is_file():
        raise PrunusError(f"resume=True: {run_dir} holds no run ({RUN_CONFIG} missing) and so no checkpoint; start a new run without resume=True")
    run = read_json_object(path, fix="re-create the run (overwrite=True)")
    if not isinstance(run.get("train"), dict):
        raise PrunusError(f"{path}: has no 'train' object; re-create the run (overwrite=True)")
    spec = get_spec(run.get("kind"))
    if expect is not None and spec.name != expect.KIND:
        raise PrunusError(f"{path}: a {spec.title}'s run, not a {get_spec(expect.KIND).title}'s (resume a generic "
                          "module's run with --model, a transformer's without)")
    return spec.load("config").from_dict(run["train"], source=str(path))


def differing_setting(cfg, saved) -> str | None:
    """The first run-defining setting (not in the kind's RESUMABLE) ``cfg`` changes from the ``saved`` run's."""
    mine, theirs = cfg.to_dict(), saved.to_dict()
    return next((k for k, v in theirs.items() if k not in cfg.RESUMABLE and k != "out" and mine.get(k) != v), None)


def check_same_run(cfg, saved, out: str | Path) -> None:
    """One line naming the flag when ``cfg`` changes a setting the ``saved`` run is defined by."""
    k = differing_setting(cfg, saved)
    if k is not None:
        raise PrunusError(f"resume=True: {cfg.flag(k)} {short(cfg.to_dict()[k])} differs from the run in {out} "
                          f"({short(saved.to_dict()[k])}); drop it (the run's own is used) or start a new run in "
                          "another out dir")


def staging_dir(out: str | Path) -> Path:
    """Where an overwriting run is written until it is complete."""
    out = Path(out)
    return out.with_name(f".{out.name}.tmp-overwrite")


def _occupied(path: Path) -> bool:
    return os.path.lexists(path) and (not path.is_dir() or path.is_symlink() or any(path.iterdir()))


def run_location(cfg, *, resume: bool, overwrite: bool) -> tuple[Path, bool, bool]:
    """(the dir this invocation writes, resume, overwrite). Under torchrun's restart after a failure, the
    run goes on from its own newest checkpoint (in the staging dir when it was overwriting)."""
    out, stage = Path(cfg.out), staging_dir(cfg.out)
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        if list_checkpoints(stage):
            return stage, True, False
        if stage.is_dir():
            return stage, False, True
        resume = bool(list_checkpoints(out))
        return (stage if not resume and _occupied(out) else out), resume, not resume
    if overwrite and not resume and _occupied(out):
        return stage, False, True
    return out, resume, overwrite


def resume_config(run_dir: str | Path, expect: type | None = None, **overrides):
    """The saved settings of the run in ``run_dir`` (its kind's settings dataclass; ``expect``: refused unless this
    one), with ``overrides`` applied."""
    saved = read_run_config(run_dir, expect)
    settings = saved.to_dict()
    settings["stop_at"] = None  # an early stop belongs to the invocation that asked for it
    settings.update(overrides, out=str(run_dir))
    return type(saved).from_dict(settings, source="the command line")


def check_run_dir(cfg, *, resume: bool, overwrite: bool, run_dir: str | Path | None = None,
                  quiet: bool = False) -> Path | None:
    """Validate the run dir for this invocation (``cfg``: any kind's settings); return the checkpoint to resume
    from, if any (``quiet``: do not say which damaged checkpoints are skipped; the launcher checks before its ranks
    say it)."""
    out = Path(cfg.out)
    check_output(out, cfg.inputs())
    work = Path(run_dir) if run_dir is not None else out
    if resume:
        check_same_run(cfg, read_run_config(work, expect=type(cfg)), out)
        ckpts = list_checkpoints(work)
        if not ckpts:
            raise PrunusError(f"resume=True: no checkpoint in {work / 'checkpoints'}; start a new run without resume=True")
        return newest_intact(ckpts, work, quiet)
    if _occupied(out) and not overwrite:
        raise PrunusError(f"{out}: already holds a run or other files; pass resume=True to continue it, overwrite=True to replace it, or choose another out dir")
    if overwrite:
        check_replaceable(out)
    writable_parent(out)
    if out.is_dir() and not os.access(out, os.W_OK | os.X_OK):
        raise PrunusError(f"--out {out}: is not writable; fix its permissions or choose another --out")
    return None


def newest_intact(ckpts: list[tuple[int, Path]], run_dir: Path, quiet: bool = False) -> Path:
    """The newest checkpoint whose files are whole, saying which newer ones were skipped and why."""
    damaged = []
    for _, path in reversed(ckpts):
        problem = checkpoint_problem(path)
        if problem is None:
            if damaged and not quiet and os.environ.get("RANK", "0") == "0":
                print(f"resume: {'; '.join(damaged)}; resuming from {path.name}, the newest intact checkpoint",
                      file=sys.stderr, flush=True)
            return path
        damaged.append(f"{path} is damaged ({problem})")
    raise PrunusError(f"resume=True: every checkpoint in {run_dir / 'checkpoints'} is damaged, the newest: {damaged[0]}; "
                      "start a new run with overwrite=True")


def init_run_dir(cfg, *, overwrite: bool, extra: dict, run_dir: str | Path | None = None) -> Path:
    """Create the dir this invocation writes (rank 0): a fresh staging dir when overwriting."""
    out = Path(run_dir) if run_dir is not None else Path(cfg.out)
    if out.parent.is_dir():
        clean_stale_temps(out.parent)
    for stale in (out / "checkpoints").glob(".step-*.tmp"):  # left by a killed run; this run is the dir's only writer
        shutil.rmtree(stale, ignore_errors=True)
    if overwrite and out == staging_dir(cfg.out) and os.path.lexists(out):
        shutil.rmtree(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PrunusError(f"--out {cfg.out}: cannot be created ({e.strerror}); choose another --out") from None
    kind = {} if cfg.KIND == TRANSFORMER else {"kind": cfg.KIND}  # a transformer's run.json names no kind
    atomic_write_json(out / RUN_CONFIG, {"train": cfg.to_dict(), **kind, **extra})
    return out


def prior_state(run_dir: str | Path, cfg) -> str:
    """What ``run_dir`` was before this invocation wrote to it: "new" (missing, or the staging dir, which an
    overwriting run always makes anew), "empty" (an empty dir made by someone else) or "run" (a run resumed)."""
    run_dir = Path(run_dir)
    if run_dir == staging_dir(cfg.out) or not os.path.lexists(run_dir):
        return "new"
    return "run" if _occupied(run_dir) else "empty"


def discard_incomplete_run(run_dir: str | Path, prior: str, out: str | Path) -> str:
    """After a failed invocation (rank 0): remove what it wrote to ``run_dir`` when nothing complete is in it (the
    dir too when ``prior`` is "new"; see :func:`prior_state`). Returns what is left, as the end of a one-line
    error: "nothing was written ...; free space ..." or which complete checkpoint (or model dir) is kept."""
    run_dir, out = Path(run_dir), Path(out)
    intact = [p for _, p in list_checkpoints(run_dir) if checkpoint_problem(p) is None] if run_dir.is_dir() else []
    staged = run_dir != out
    if intact or (run_dir / "model").is_dir() or prior == "run":
        kept = intact[-1] if intact else run_dir / "model" if (run_dir / "model").is_dir() else run_dir
        if staged:
            return (f"{out} is as it was and the new run's {kept.name} is kept in {run_dir} (a restart under torchrun "
                    "continues from it); free space and run again")
        return f"{kept} is kept; free space and continue with --resume"
    entries = [run_dir] if prior == "new" else list(run_dir.iterdir()) if run_dir.is_dir() else []
    for entry in entries:  # a dir someone made empty is emptied again and kept
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
    where = (f"{out} is as it was" if staged else "the incomplete run dir is removed" if prior == "new"
             else f"{out} is empty again")
    return f"nothing was written ({where}); free space or choose another --out"


def raise_run_failure(error: BaseException, run_dir: str | Path, prior: str | None, out: str | Path):
    """Re-raise ``error`` once what this invocation wrote to ``run_dir`` is removed when nothing complete is in it
    (rank 0, :func:`discard_incomplete_run`; ``prior`` None: nothing written yet); a write the disk refused becomes
    one line saying what is left."""
    if prior is None:
        raise error
    left = discard_incomplete_run(run_dir, prior, out)
    reason = disk_error(error)
    if reason is None:
        raise error
    raise PrunusError(f"{out}: writing the run failed ({reason}); {left}") from None


def publish_run_dir(cfg, run_dir: str | Path) -> Path:
    """Put a finished staging dir in place of the old run (rank 0, at the end of the invocation)."""
    out, run_dir = Path(cfg.out), Path(run_dir)
    if run_dir != out:
        replace_dir(run_dir, out)
    return out
