"""What a training run returns, whichever kind and loop ran it (the Trainer's, a kind's, the parameter server's)."""

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
    best: dict | None = None  # a kept best checkpoint's record (checkpoint/best.py), None without one
    model_from: str = "last"  # which weights the model dir holds: "last" or "best"
