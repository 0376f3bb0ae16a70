"""`specq models [--json]` and `specq models pull NAME...`: the model catalogue (models/catalogue.py)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from specq.cli.group import cli
from specq.cli.options import specq_errors

if TYPE_CHECKING:
    from specq.models.catalogue import CatalogueModel


@cli.group("models", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of the catalogue's models.")
@click.pass_context
def models(ctx: click.Context, as_json: bool) -> None:
    """The catalogue of models specq fetches by name, and what of each is local: its GGUF file and its
    converted folder, per dtype. `--target NAME` and `--draft NAME` take these names."""
    if ctx.invoked_subcommand is not None:
        return
    from specq.models.catalogue import local_states
    from specq.models.pull import mib

    states = local_states()
    if as_json:
        click.echo(json.dumps([state.to_json() for state in states]))
        return
    from specq.cli.tables import print_table

    rows = [
        [
            state.model.name,
            state.model.family,
            mib(state.model.size),
            "yes" if state.local else "no",
            mib(state.bytes_on_disk) if state.bytes_on_disk else "-",
            ", ".join(state.converted) or "-",
        ]
        for state in states
    ]
    columns = ["name", "family", "download", "local", "on disk", "converted"]
    print_table(columns, rows, drop=("converted", "on disk", "family"))


@models.command("pull")
@click.argument("names", nargs=-1, required=True)
def pull(names: tuple[str, ...]) -> None:
    """Fetch, assemble, check (size, SHA-256) and convert each named model into specq's data directory,
    with a progress line per phase. Nothing is installed into this environment, and a failure keeps
    nothing half-fetched: exit 1 where a fetch fails, 2 for a name the catalogue does not hold."""
    from specq.models.catalogue import find, unknown_name_message

    wanted = []
    for name in dict.fromkeys(names):  # every name checked before anything is fetched
        model = find(name)
        if model is None:
            raise click.BadParameter(unknown_name_message(name), param_hint="NAME")
        wanted.append(model)
    with specq_errors():
        for model in wanted:
            pull_saying(model)


def pull_saying(model: CatalogueModel) -> None:
    """Pull `model` with its progress lines on stderr, and a `still pulling` line in any silence between
    them (a wait on another process's lock, a slow step): never quiet for SILENCE_LIMIT_S."""
    from specq.models.pull import pull as pull_model
    from specq.speaking import Speaker

    speaker = Speaker(lambda line: click.echo(line, err=True))
    with speaker.watching(f"pulling {model.name}"):
        pull_model(model, progress=speaker.say)
