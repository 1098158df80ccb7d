"""Training checkpoints with torch.distributed.checkpoint (DCP).

``RUN_DIR/checkpoints/step-N/`` holds the model and optimizer state keyed by
parameter name, the optimizer state flattened (``state.<param>.exp_avg``) so it
reloads under any layout: saved under FSDP x 2, resumed under TP x 2, PP x 2 or
one process. ``train_state.json`` holds the step, tokens and elapsed time.

A checkpoint is written under a temporary name and renamed when every rank has
finished, so a killed run never leaves one that looks complete; only the newest
``keep`` are kept. ``train_state.json`` also records the size of every file, so a
truncated or missing file is found before loading (:func:`checkpoint_problem`) and
``--resume`` falls back to the newest intact checkpoint. :class:`Checkpointer` can write asynchronously
(``dcp.async_save``): the state is staged to memory, written by a background
thread while training goes on, and published at the next save or at the end.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import warnings
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from prunus.artifacts.atomic import atomic_write_json, discard_on_error, replace_dir
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import read_json_object, short

from .checkpoint_reader import CheckpointUnreadable, SafePlanner, SafeReader, read_metadata

_STEP_DIR = re.compile(r"^step-(\d+)$")
TRAIN_STATE = "train_state.json"
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_PARTIAL = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _is_main() -> bool:
    return not _distributed() or dist.get_rank() == 0


@contextlib.contextmanager
def _quiet():
    # DCP warns that it assumes a single process even when told so with no_dist
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / TRAIN_STATE).is_file()]
    return sorted(found)


def _local(opt):
    """ZeRO-1's ZeroRedundancyOptimizer holds this rank's shard in a plain optimizer: save that, keyed by
    parameter name, and the shards of all ranks make the whole state."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt


def _state(parts, optimizers) -> dict:
    model, optim = {}, {}
    for part, opt in zip(parts, map(_local, optimizers)):
        model.update(get_model_state_dict(part))
        optim.update(get_optimizer_state_dict(part, opt, options=_FLAT))
    return {"model": model, "optim": optim}


def _paths(run_dir: str | Path, step: int) -> tuple[Path, Path]:
    root = Path(run_dir) / "checkpoints"
    tmp = root / f".step-{step}.tmp"
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    return root / f"step-{step}", tmp


def _publish(run_dir: str | Path, step: int, tmp: Path, final: Path, train_state: dict, keep: int) -> Path:
    """Once every rank has written its shards: rank 0 adds the train state and renames."""
    _barrier()
    if _is_main():
        with _discard_on_error(tmp):
            sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
            atomic_write_json(tmp / TRAIN_STATE, {"step": step, **train_state, "files": sizes})
        replace_dir(tmp, final)  # a step saved again (after a resume) replaces the old one only once complete
        for _, old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _discard_on_error(tmp: Path):
    """A checkpoint that fails to write leaves no ``.step-N.tmp`` behind; a full or read-only disk is one line."""
    return discard_on_error(tmp, f"{tmp.parent}: writing a checkpoint failed ({{reason}}); free space and continue "
                                 "with --resume from the last checkpoint", remove=_is_main())


def save_checkpoint(run_dir: str | Path, step: int, parts, optimizers, train_state: dict, keep: int = 2) -> Path:
    """Save on every rank (a collective); rank 0 publishes the checkpoint when all are done."""
    final, tmp = _paths(run_dir, step)
    with _quiet(), _discard_on_error(tmp):
        dcp.save(_state(parts, optimizers), checkpoint_id=tmp, no_dist=not _distributed())
    return _publish(run_dir, step, tmp, final, train_state, keep)


class Checkpointer:
    """Checkpoints of one run, written synchronously or, with ``use_async``, in the background.

    An async save stages the state to memory (training may then change the
    parameters), writes it from a thread over its own Gloo group (so its
    collectives never interleave with training's), and is published, renamed to
    ``step-N``, by :meth:`wait`, which the next save and the end of the run call.
    """

    def __init__(self, run_dir: str | Path, keep: int = 2, use_async: bool = False):
        self.run_dir, self.keep, self.use_async = Path(run_dir), keep, use_async
        self._group = dist.new_group(backend="gloo") if use_async and _distributed() else None
        self._pending = None

    def save(self, step: int, parts, optimizers, train_state: dict) -> None:
        self.wait()
        if not self.use_async:
            save_checkpoint(self.run_dir, step, parts, optimizers, train_state, self.keep)
            return
        final, tmp = _paths(self.run_dir, step)
        with _quiet():
            future = dcp.async_save(_state(parts, optimizers), checkpoint_id=tmp, process_group=self._group,
                                    no_dist=not _distributed())
        self._pending = (step, tmp, final, dict(train_state), future)

    def wait(self) -> Path | None:
        """Finish and publish the checkpoint in flight, if any; return its path."""
        if self._pending is None:
            return None
        step, tmp, final, train_state, future = self._pending
        self._pending = None
        with _discard_on_error(tmp):
            future.result()
        return _publish(self.run_dir, step, tmp, final, train_state, self.keep)


def read_train_state(path: str | Path) -> dict:
    """``train_state.json`` of a checkpoint, its types checked: {"step", "tokens", "elapsed_s"[, "files"]}."""
    where = Path(path) / TRAIN_STATE
    state = read_json_object(where, fix="resume from another checkpoint")
    for key, ok in (("step", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                    ("tokens", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                    ("elapsed_s", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf"))):
        if not ok(state.get(key)):
            raise PrunusError(f"{where}: '{key}' is {short(state.get(key))}; resume from another checkpoint")
    files = state.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in files.values()):
        raise PrunusError(f"{where}: 'files' is not an object of file sizes; resume from another checkpoint")
    outside = [k for k in files if not k or "/" in k or "\\" in k or k in (".", "..") or "\0" in k]
    if outside:
        raise PrunusError(f"{where}: 'files' names {short(outside[0])}, not a file of the checkpoint dir; "
                          "resume from another checkpoint")
    return state


def checkpoint_problem(path: str | Path) -> str | None:
    """Why the checkpoint at ``path`` cannot load as it stands (a file missing, truncated or unreadable), or None."""
    path = Path(path)
    try:
        state = read_train_state(path)
    except PrunusError as e:
        return str(e).split(": ", 1)[-1].split(";")[0] + f" ({TRAIN_STATE})"
    for name, size in state.get("files", {}).items():
        f = path / name
        if not f.is_file() or f.stat().st_size != size:
            return f"{name} is {'missing' if not f.is_file() else f'{f.stat().st_size} bytes, not {size}'}"
    try:
        read_metadata(path)
    except CheckpointUnreadable as e:
        return str(e)
    return None


def _dcp_load(state: dict, path: Path, no_dist: bool) -> None:
    """``dcp.load`` through the reader and planner that unpickle nothing but allow-listed metadata and values."""
    with _quiet():
        dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner(), no_dist=no_dist)


def load_checkpoint(path: str | Path, parts, optimizers) -> dict:
    """Load model and optimizer state in place, whatever layout saved it; return the train state."""
    path = Path(path)
    state = _state(parts, optimizers)
    _dcp_load(state, path, no_dist=not _distributed())
    for part, opt in zip(parts, map(_local, optimizers)):
        set_model_state_dict(part, state["model"], options=_PARTIAL)
        set_optimizer_state_dict(part, opt, state["optim"], options=_FLAT)
    train_state = read_train_state(path)
    train_state.pop("files", None)  # the next checkpoint records its own
    return train_state


def load_model_weights(path: str | Path, model) -> None:
    """Fill a plain (unparallelized) model from a checkpoint, in this process alone."""
    state = {"model": get_model_state_dict(model)}
    _dcp_load(state, Path(path), no_dist=True)
    set_model_state_dict(model, state["model"])
