"""What a training run returns, whichever loop ran it (the Trainer's or the parameter server's)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class TrainResult:
    run_dir: Path
    model_dir: Path | None  # None when the run stopped early (--stop-at), or on ranks other than 0
    step: int
    metrics: dict  # the last record (with the last evaluation's figures)
    losses: list[float]  # training loss of each step run in this invocation
