"""prunus.train_parallel: the training engine (mesh, DDP/FSDP, TP/SP, PP, CP, EP, checkpoints, launch, the train loop).

The loop and what composes it sit at the top (``trainer.py``, ``config.py``, ``parallel_dims.py``,
``parallelize.py``, ``activation_checkpointing.py``, ``lora.py``, ``schedule.py``, and the run dir's records:
``run_dir.py``, ``metrics.py``, ``progress.py``, ``plot.py``, ``flops.py``); each parallelism and concern is a
sub-package: ``data_parallel/``, ``tensor_parallel/``, ``pipeline/``, ``context_parallel/``, ``experts/``,
``checkpoint/`` and ``launch/`` (with the dry run).

Public names are imported from their submodules on first use (:mod:`prunus.artifacts.lazy`), so that
reading :class:`TrainConfig` (``prunus train --help``) does not import torch.
"""

from prunus.artifacts.lazy import lazy_package

_EXPORTS = {
    "list_checkpoints": "checkpoint.checkpoint", "load_checkpoint": "checkpoint.checkpoint",
    "save_checkpoint": "checkpoint.checkpoint", "TrainConfig": "config", "read_metrics": "metrics",
    "resume_config": "run_dir", "lr_at": "schedule", "Trainer": "trainer", "TrainResult": "trainer", "train": "trainer",
}
__all__ = list(_EXPORTS)
lazy_package(__name__, _EXPORTS)
