"""The `specq` command group. Each command module adds itself to it; cli/main.py imports them all."""

from __future__ import annotations

import logging
import os
import sys

import click

from specq import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="specq")
@click.option("-v", "--verbose", count=True, help="More log output on stderr (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """specq: batch speculative decoding. JSONL in, completions and metrics out."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _tame_library_logs(verbose)
    from specq.masking import mask_process_title, register_urls

    # credentials come from URLs only; no log line shows them (commands add URLs given as flags), nor `ps`
    register_urls(os.environ.get("SPECQ_DATABASE_URL"), os.environ.get("SPECQ_BROKER_URL"))
    mask_process_title(sys.argv)


def _tame_library_logs(verbose: int) -> None:
    """Each library line once, and no retry chatter unless asked for (-v). huggingface_hub gives its logger a
    handler of its own yet lets records reach the root's too (each line twice), and warns at every retry of a
    request (44 lines in a minute where the hub is out of reach); its final error says what failed."""
    logging.getLogger("huggingface_hub").propagate = False
    logging.getLogger("huggingface_hub.utils._http").setLevel(logging.ERROR if verbose == 0 else logging.NOTSET)
