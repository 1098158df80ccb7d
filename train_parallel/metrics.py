"""``metrics.jsonl``: one JSON record per logged step (train loss, lr, grad norm, tokens/s, elapsed; val figures on eval steps)."""

from __future__ import annotations

import json
from pathlib import Path

METRICS = "metrics.jsonl"


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / METRICS
    if not path.is_file():
        return []
    records = []
    for line in path.read_bytes().decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line) if line.strip() else None
        except (ValueError, RecursionError):  # a torn line (a killed process) or a damaged one: the records before it stand
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


class MetricsLog:
    """Appends records; on resume, first drops records past the checkpoint being resumed."""

    def __init__(self, run_dir: str | Path, resume_step: int | None = None):
        self.path = Path(run_dir) / METRICS
        if resume_step is not None:
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        elif self.path.exists():
            self.path.unlink()
        self._f = open(self.path, "a")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
