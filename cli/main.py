"""The `specq` console script: the command group (cli/group.py) with every command registered on it.
Subcommands live in their own modules and only parse and delegate."""

from __future__ import annotations

from specq.cli.group import cli

__all__ = ["cli", "main"]


def _register() -> None:
    # Each command module adds itself to `cli`; imports stay light so `specq --help` needs no torch.
    from specq.cli import commands  # noqa: F401


def main() -> None:
    _register()
    cli()
