"""Wall-clock timing of device work, shared by `jspec bench` and the calibrations."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of `repeats` calls of `fn` after one warm-up call (compilation excluded).
    `fn` must wait for its device work (`jax.block_until_ready`, or a host read)."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
