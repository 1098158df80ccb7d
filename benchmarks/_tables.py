"""What the benchmarks print their figures with: one rich table per section, and the ratio / goal cells."""

from __future__ import annotations


def show(title: str, headers: list[str], rows: list[list[str]], width: int = 120) -> None:
    """A table: the first column left-aligned (labels), the others right-aligned (figures)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=max(width, len(title) + 4)).print(table)


def fmt(v: float | None, spec: str = ",.0f") -> str:
    return "n/a" if v is None else format(v, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def goal(v: float | None, ok) -> str:
    """Whether a figure meets its goal (``ok(v)``): yes, no, or n/a when it was not measured."""
    return "n/a" if v is None else ("yes" if ok(v) else "no")
