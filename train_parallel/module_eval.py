"""``prunus eval`` of a generic module dir: the task's held-out figures on a dataset, scored as the trainer scores.

The module is rebuilt by its factory (imported only when trusted, :func:`prunus.models.module_dir.load_module`),
the data spec read as ``prunus train --data`` reads it (its held-out split), and the figures computed by
:func:`.module_trainer.score_module`: ``val_loss`` (cross-entropy for classification, mean squared error for
regression, the task's loss otherwise), ``val_accuracy`` (top-1) for classification, ``val_samples``.
"""

from __future__ import annotations

from pathlib import Path

from prunus.artifacts.errors import PrunusError

MAX_BATCH, MAX_SAMPLES = 65_536, 1 << 30


def evaluate_module_dir(path, data: str, *, trust_factory=False, batch_size: int = 64, max_samples: int = 4096,
                        val_fraction: float = 0.1, record: bool = True, device: str = "cpu") -> dict:
    """The held-out figures of the generic module dir at ``path`` on ``data``'s held-out split (a data spec:
    an image folder, tar shards or ``synthetic:...``); with ``record``, merged into its manifest."""
    from prunus.data.global_batches import check_pair
    from prunus.data.module_datasets import module_datasets
    from prunus.models.model_dir import update_manifest_metrics, verify_model_dir
    from prunus.models.module_dir import load_module, read_module_config
    from prunus.models.tasks import get_task

    from .module_trainer import score_module

    if not 1 <= batch_size <= MAX_BATCH:
        raise PrunusError(f"--batch-size {batch_size} must be from 1 to {MAX_BATCH:,}")
    if not 1 <= max_samples <= MAX_SAMPLES:
        raise PrunusError(f"--max-samples {max_samples} must be from 1 to {MAX_SAMPLES:,}")
    if not 0 < val_fraction < 1:
        raise PrunusError(f"--val-fraction {val_fraction} must be between 0 and 1")
    path = Path(path)
    verify_model_dir(path)
    config = read_module_config(path)
    task = get_task(config.get("task") or "classification", trust=trust_factory, where=str(path))
    _, val = module_datasets(data, val_fraction)
    if val is None or len(val) == 0:
        raise PrunusError(f"--data {data}: holds no held-out samples to score; give data with a held-out split")
    check_pair(val, "--data")
    model = load_module(path, config, trust_factory=trust_factory, device=device)
    try:
        figures = score_module(model, task, val, batch_size=batch_size, max_samples=max_samples, device=device)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:  # a shape the module does not take
        from prunus.models.module_factory import reason

        raise PrunusError(f"--data {data}: the module in {path} could not score it ({reason(e)}); give data of "
                          "the input and target the module was trained on") from None
    figures = {**figures, "eval_data": data, "task": task.name}
    if record:
        update_manifest_metrics(path, figures)
    return figures
