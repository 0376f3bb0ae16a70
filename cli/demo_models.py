"""`specq demo-models`: name (and pull) the catalogue's demo pair, for `eval`."""

from __future__ import annotations

import click

from specq.cli.group import cli
from specq.cli.options import specq_errors


@cli.command("demo-models")
@click.option(
    "--pull/--no-pull",
    default=True,
    show_default=True,
    help="Fetch and convert the pair now (progress on stderr), so that the next command starts decoding at once.",
)
def demo_models(pull: bool) -> None:
    """Print `target=NAME` and `draft=NAME` on stdout, for `eval`: the catalogue's Qwen2.5-Coder pair
    (`specq models` lists the catalogue). Nothing is trained; a pulled model is reused."""
    from specq.models.catalogue import DEMO_DRAFT, DEMO_TARGET

    if pull:
        pull_pair(DEMO_TARGET, DEMO_DRAFT)
    click.echo(f"target={DEMO_TARGET}")
    click.echo(f"draft={DEMO_DRAFT}")


def pull_pair(*names: str) -> None:
    """`specq models pull NAMES`, its progress lines on stderr: stdout stays the two lines `eval` reads."""
    from specq.cli.models import pull_saying
    from specq.models.catalogue import find

    with specq_errors():
        for name in names:
            model = find(name)
            assert model is not None, name  # the demo names are catalogue names (tests/test_demo_pair_names.py)
            pull_saying(model)
