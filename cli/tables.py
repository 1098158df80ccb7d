"""Tables that fit the terminal: a number is never cut to "1.99…"; low-priority columns are dropped instead.

rich shrinks columns that do not fit and ends their cells with "…". For figures that is
a wrong number, so :func:`fitted_table` gives every figure column the width of its
widest cell (no wrapping, no shrinking), lets text columns wrap, and when even that is
wider than the console, drops columns from the lowest priority up and names them in a
footnote line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

WIDE_PIPE = 150  # width when the output is not a terminal and COLUMNS is not set (a file keeps whole rows)


@dataclass
class Column:
    header: str
    justify: str = "right"
    text: bool = False  # free text: may wrap; figures never do
    priority: int = 0  # columns of the lowest priority are dropped first; 0: never dropped


def console_for_tables():
    """A rich Console whose width is the terminal's, COLUMNS when set, else :data:`WIDE_PIPE` for a pipe or file."""
    from rich.console import Console  # here, not at the top: a verb's --help does not pay for rich

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = max(console.width, WIDE_PIPE)
    return console


def _table_width(columns: list[Column], rows: list[list[str]], keep: list[int]) -> int:
    """Width rich needs for the kept columns at their natural widths: cells + 2 padding each + borders."""
    widths = []
    for i in keep:
        col = columns[i]
        cells = [col.header, *(r[i] for r in rows)]
        longest = max(len(word) for c in cells for word in c.split()) if col.text else max(len(c) for c in cells)
        widths.append(min(longest, 12) if col.text else longest)  # a text column can wrap down to ~12 characters
    return sum(w + 2 for w in widths) + len(widths) + 1


def fitted_table(columns: list[Column], rows: list[list[str]], width: int, **table_args):
    """A rich Table of ``rows`` at most ``width`` wide, and the headers of the columns dropped to fit."""
    from rich.table import Table

    keep = list(range(len(columns)))
    droppable = sorted((c.priority, -i) for i, c in enumerate(columns) if c.priority > 0)
    dropped = []
    while _table_width(columns, rows, keep) > width and droppable:
        _, neg_i = droppable.pop(0)
        keep.remove(-neg_i)
        dropped.append(columns[-neg_i].header)
    table = Table(**table_args)
    for i in keep:
        col = columns[i]
        if col.text:
            table.add_column(col.header, justify=col.justify, overflow="fold")
        else:
            longest = max(len(c) for c in [col.header, *(r[i] for r in rows)])
            table.add_column(col.header, justify=col.justify, no_wrap=True, min_width=longest)
    for r in rows:
        table.add_row(*(r[i] for i in keep))
    return table, dropped


def print_fitted(console, columns: list[Column], rows: list[list[str]], **table_args) -> None:
    """Print :func:`fitted_table` at the console's width, with a footnote naming any columns left out."""
    table, dropped = fitted_table(columns, rows, console.width, **table_args)
    console.print(table)
    if dropped:
        console.print(f"not shown at this width ({console.width} columns): {', '.join(dropped)}; widen the terminal "
                      "or set COLUMNS to see them")
