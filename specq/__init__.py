"""specq: a batch engine for lossless speculative decoding."""

from pathlib import Path as _Path

from specq import layout as _layout

# The one place the version is written: pyproject.toml reads it (dynamic), `specq --version` prints it,
# and tests/test_version.py checks that the changelog and the deploy files name the same release.
__version__ = "0.4.0"

# a checkout without the links to the parts (specq/layout.py) says so, not "No module named specq.cli"
_missing = _layout.missing_parts(_Path(__file__).parent)
if _missing:
    raise ImportError(_layout.missing_parts_error(_missing))
