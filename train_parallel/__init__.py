"""prunus.train_parallel: the training engine (single process now; parallel layouts build on it)."""

from .checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .metrics import read_metrics
from .run_dir import resume_config
from .schedule import lr_at
from .trainer import TrainResult, train

__all__ = ["list_checkpoints", "load_checkpoint", "save_checkpoint", "TrainConfig", "read_metrics",
           "resume_config", "lr_at", "TrainResult", "train"]
