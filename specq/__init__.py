"""specq: a batch engine for lossless speculative decoding."""

# The one place the version is written: pyproject.toml reads it (dynamic), `specq --version` prints it,
# and tests/test_version.py checks that the changelog and the deploy files name the same release.
__version__ = "0.3.0"
