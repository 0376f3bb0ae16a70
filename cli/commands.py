"""Imports every command module so that each registers itself on the `cli` group."""

# One import per command module; keep them light (no torch at import time).
from cli import bench  # noqa: F401
from cli import cancel, db, export, run, status, submit, worker  # noqa: F401
from cli import demo_models  # noqa: F401
