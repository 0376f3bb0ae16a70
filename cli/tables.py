"""Tables on stdout, for `status` and `workers`: never cut where a script or a file reads them, and on a
narrow terminal whole columns dropped, least useful first, never a cell cut or folded (an id or a name
cut short cannot be pasted into the next command)."""

from __future__ import annotations

import shutil
import sys

import click


def aligned(columns: list[str], rows: list[list[str]], indent: str = "") -> list[str]:
    """The table as text lines, each column as wide as its widest cell, two spaces apart; nothing cut."""
    widths = [max(len(cell) for cell in column) for column in zip(columns, *rows, strict=True)]
    return [
        (indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))).rstrip()
        for row in [columns, *rows]
    ]


def fitted(columns: list[str], rows: list[list[str]], drop: tuple[str, ...], width: int) -> tuple[list[str], list[str]]:
    """(the table's lines, the columns left out): the columns of `drop` are left out in that order until
    the lines fit in `width`; the others stay whatever the width (the terminal wraps a longer line)."""
    left_out: list[str] = []
    lines = aligned(columns, rows)
    for name in drop:
        if max(len(line) for line in lines) <= width:
            break
        i = columns.index(name)
        columns = columns[:i] + columns[i + 1 :]
        rows = [row[:i] + row[i + 1 :] for row in rows]
        left_out.append(name)
        lines = aligned(columns, rows)
    return lines, left_out


def print_table(columns: list[str], rows: list[list[str]], drop: tuple[str, ...]) -> None:
    """Print the table on stdout, every cell whole. Not a terminal (a pipe, a file): every column. A
    terminal narrower than the table: the columns of `drop` left out, in that order, until it fits, and
    a note on stderr naming them."""
    left_out: list[str] = []
    if not sys.stdout.isatty():
        lines = aligned(columns, rows)
    else:
        lines, left_out = fitted(columns, rows, drop, shutil.get_terminal_size().columns)
    for line in lines:
        click.echo(line)
    if left_out:
        click.echo(f"({', '.join(left_out)} left out to fit the terminal; --json, or a pipe, shows all)", err=True)
