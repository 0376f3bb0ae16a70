"""Where specq keeps its own files (the embedded database, the demo models)."""

import os
from pathlib import Path

import platformdirs


def data_dir() -> Path:
    """specq's data directory: `SPECQ_HOME` if set, else the platform's user data dir."""
    root = os.environ.get("SPECQ_HOME") or platformdirs.user_data_dir("specq", appauthor=False)
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
