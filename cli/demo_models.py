"""`specq demo-models [DIR]`: build (or find) the offline demo draft/target pair."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from specq.cli.group import cli
from specq.errors import SpecqError


@cli.command("demo-models")
@click.argument("directory", required=False, type=click.Path(file_okay=False, writable=True, path_type=Path))
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the whole build.")
@click.option("--force", is_flag=True, help="Rebuild even if a finished build is already there.")
def demo_models(directory: Path | None, seed: int, force: bool) -> None:
    """Build the demo target and draft models from the Python standard library's sources, on CPU, in
    a few minutes; a finished build is reused. DIR defaults to specq's data directory.

    Prints `target=DIR` and `draft=DIR` on stdout, for `eval`.
    """
    # Progress goes to stderr even without -v; -vv still shows debug lines.
    models_logger = logging.getLogger("specq.models")
    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    previous = (models_logger.level, models_logger.propagate)
    models_logger.setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    models_logger.propagate = False
    models_logger.addHandler(handler)
    try:
        from specq.models.demo import build_demo_models

        demo = build_demo_models(directory, seed=seed, force=force)
    except (OSError, SpecqError) as exc:
        raise click.ClickException(f"cannot build the demo models: {exc}") from None
    finally:
        models_logger.removeHandler(handler)
        models_logger.setLevel(previous[0])
        models_logger.propagate = previous[1]
    report = demo.report
    click.echo(
        f"acceptance {report['acceptance_rate']:.3f}, decode forward target {report['t_target_ms']:.2f} ms, "
        f"draft {report['t_draft_ms']:.2f} ms (c {report['cost_ratio']:.3f}), "
        f"speedup bound at K=4 {report['speedup_bound_k4']:.2f}",
        err=True,
    )
    click.echo(f"target={demo.target_dir}")
    click.echo(f"draft={demo.draft_dir}")
