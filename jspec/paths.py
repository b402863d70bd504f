"""Where jspec keeps what it builds or downloads once (a leaf module: imports nothing of jspec)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["cache_dir", "cache_lock"]


def cache_dir() -> Path:
    """`$JSPEC_CACHE`, default `~/.cache/jspec`."""
    return Path(os.environ.get("JSPEC_CACHE") or Path.home() / ".cache" / "jspec")


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold an exclusive lock on cache entry `name` across processes (an advisory `flock` on
    `<cache>/.locks/<name>`): several processes that fill the same entry at once (test workers,
    the ranks of a launch) then download or convert it once, and none reads a half-made one."""
    path = cache_dir() / ".locks" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
