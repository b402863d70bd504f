"""The Mosaic GPU calls whose signature changed between the jax versions pyproject allows
(0.10 to the newest): one place that works on both, used by both `kernel_mgpu.py` files.

- `plgpu.load(ref, idx, ...)` lost its index argument in jax 0.12 (index the ref instead:
  `ref.at[idx]`); `load` below takes the index on every version.
- `plgpu.transpose_ref` was removed in jax 0.12.1; `ref.transpose(perm)` works on every version,
  so the kernels call that directly.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

_LOAD_TAKES_INDEX = "idx" in inspect.signature(plgpu.load).parameters


def load(ref: Any, idx: Any, *, layout: Any = None, optimized: bool = True) -> jax.Array:
    """`plgpu.load` of `ref[idx]` (`()`: the whole ref) with `layout`, on any jax version."""
    if _LOAD_TAKES_INDEX:
        return plgpu.load(ref, idx, layout=layout, optimized=optimized)
    return plgpu.load(ref if idx == () else ref.at[idx], layout=layout, optimized=optimized)
