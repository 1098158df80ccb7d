"""Progress of a run: a rich progress bar on a terminal, plain lines otherwise (logs, CI)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _fmt(record: dict) -> str:
    parts = [f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}", f"{record['tokens_per_s']:,.0f} tok/s"]
    if "val_loss" in record:
        parts.append(f"val {record['val_loss']:.4f} ({record['val_bpb']:.3f} bpb)")
    return "  ".join(parts)


class TrainProgress:
    def __init__(self, total: int, start: int, enabled: bool = True, log_every: int = 10, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.enabled, self.total, self.log_every = enabled, total, log_every
        self._bar = None
        if enabled and self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(), TimeRemainingColumn(), console=self.console,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, info="")

    def __enter__(self):
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.stop()

    def update(self, record: dict) -> None:
        step = record["step"]
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=_fmt(record))
            if "val_loss" in record:
                self._bar.console.print(f"step {step}: {_fmt(record)}")
        elif self.enabled and (step % self.log_every == 0 or step == self.total or "val_loss" in record):
            self.console.print(f"step {step}/{self.total}  {_fmt(record)}", highlight=False)

    def print(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, highlight=False)
