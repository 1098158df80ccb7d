"""prunus.train_parallel: the training engine (mesh, DDP/FSDP, TP/SP, PP, CP, EP, checkpoints, launch, the train loop).

Public names are imported from their submodules on first use (:mod:`prunus.artifacts.lazy`), so that
reading :class:`TrainConfig` (``prunus train --help``) does not import torch.
"""

from prunus.artifacts.lazy import lazy_package

_EXPORTS = {
    "list_checkpoints": "checkpoint", "load_checkpoint": "checkpoint", "save_checkpoint": "checkpoint",
    "TrainConfig": "config", "read_metrics": "metrics", "resume_config": "run_dir", "lr_at": "schedule",
    "Trainer": "trainer", "TrainResult": "trainer", "train": "trainer",
}
__all__ = list(_EXPORTS)
lazy_package(__name__, _EXPORTS)
