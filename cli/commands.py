"""Imports every command module so that each registers itself on the `cli` group."""

# One import per command module; keep them light (no torch at import time).
from specq.cli import (  # noqa: F401
    autoscale,
    bench,
    cancel,
    db,
    demo_models,
    draft,
    export,
    models,
    run,
    status,
    submit,
    wait,
    worker,
)
