"""Tables on stdout, for `status` and `workers`: never cut where a script or a file reads them, and on a
terminal cut only where the screen is too narrow, never in an id or a name."""

from __future__ import annotations

import click


def aligned(columns: list[str], rows: list[list[str]], indent: str = "") -> list[str]:
    """The table as text lines, each column as wide as its widest cell, two spaces apart; nothing cut."""
    widths = [max(len(cell) for cell in column) for column in zip(columns, *rows, strict=True)]
    return [
        (indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))).rstrip()
        for row in [columns, *rows]
    ]


def print_table(columns: list[str], rows: list[list[str]], whole: tuple[str, ...]) -> None:
    """Print the table on stdout. Not a terminal (a pipe, a file): every cell whole, however wide. A
    terminal: fitted to its width, the `whole` columns (ids, names) never cut, the others folded."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        for line in aligned(columns, rows):
            click.echo(line)
        return
    table = Table(box=None)
    for name in columns:
        keep = name in whole
        table.add_column(name, no_wrap=keep, overflow="fold", min_width=_widest(name, columns, rows) if keep else None)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _widest(name: str, columns: list[str], rows: list[list[str]]) -> int:
    i = columns.index(name)
    return max(len(cell) for cell in [name, *(row[i] for row in rows)])
