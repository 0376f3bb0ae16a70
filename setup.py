"""The build's one step before setuptools (configured in pyproject.toml): refuse a checkout without the
links to specq's parts, whose wheel would silently hold none of them (specq/layout.py)."""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup

package = Path(__file__).resolve().parent / "specq"
spec = importlib.util.spec_from_file_location("specq_layout", package / "layout.py")
assert spec is not None and spec.loader is not None
layout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layout)
missing = layout.missing_parts(package)
if missing:
    sys.exit(f"error: {layout.missing_parts_error(missing)}")
setup()
