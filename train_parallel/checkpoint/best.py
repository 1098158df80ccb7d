"""The best checkpoint of a run: ``checkpoints/best/`` beside the step checkpoints (which ``--resume`` continues from).

It holds the weights of the step whose held-out figure was best so far (``val_accuracy``, highest, for a
classifier; else ``val_loss``, lowest) as ``model.safetensors`` and ``best.json`` (``step``, ``metric``,
``value``, the step's ``figures``, the weights' ``sha256``), each file written atomically, the record last.
"""

from __future__ import annotations

from pathlib import Path

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import read_json_object

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
