"""Imports every command module so that each registers itself on the `cli` group."""

# One import per command module; keep them light (no torch at import time).
