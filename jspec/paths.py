"""Where jspec keeps what it builds or downloads once (a leaf module: imports nothing of jspec)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """`$JSPEC_CACHE`, default `~/.cache/jspec`."""
    return Path(os.environ.get("JSPEC_CACHE") or Path.home() / ".cache" / "jspec")
