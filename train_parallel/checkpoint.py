"""Training checkpoints with torch.distributed.checkpoint (DCP).

``RUN_DIR/checkpoints/step-N/`` holds the model and optimizer state keyed by
parameter name (DCP's format, reshardable under another layout) and
``train_state.json`` (step, tokens, elapsed time). A checkpoint is written under
a temporary name and renamed when complete, so a killed run never leaves one
that looks complete; only the newest ``keep`` are kept.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import warnings
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from prunus.models.atomic import atomic_write_json

_STEP_DIR = re.compile(r"^step-(\d+)$")
TRAIN_STATE = "train_state.json"


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


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


def save_checkpoint(run_dir: str | Path, step: int, model, optimizer, train_state: dict, keep: int = 2) -> Path:
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp, no_dist=_no_dist())
    atomic_write_json(tmp / TRAIN_STATE, {"step": step, **train_state})
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for _, old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path, model, optimizer) -> dict:
    """Load model and optimizer state in place; return the train state."""
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _quiet():
        dcp.load(state, checkpoint_id=path, no_dist=_no_dist())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return json.loads((path / TRAIN_STATE).read_text())
