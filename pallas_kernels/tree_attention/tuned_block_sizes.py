"""Tuning table for `tree_attention`: prefix slots per tile (`block_kv`).

Untuned: no accelerator has run this kernel yet (see docs/BENCHMARKS.md). The entries are
starting points from the usual TPU rules (a tile of keys of a few hundred KiB, multiples of 128
slots); `python -m pallas_kernels.bench` on a device is how they should be replaced.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from pallas_kernels import _platform

# (device kind substring, dtype name) -> preferred block_kv. First match wins; "" matches all.
TUNED_BLOCK_KV: dict[tuple[str, str], int] = {
    ("TPU v5 lite", "bfloat16"): 512,
    ("TPU v5 lite", "float32"): 256,
    ("TPU v6", "bfloat16"): 1024,
    ("TPU v6", "float32"): 512,
    ("", "bfloat16"): 512,
    ("", "float32"): 256,
}


def _device_kind() -> str:
    return _platform.device_kind()


def pick_block_kv(capacity: int, dtype: Any, device_kind: str | None = None) -> int:
    """The tuned block_kv for this device and dtype, shrunk to the largest divisor of `capacity`.

    Args:
      capacity: S, the cache slots per row.
      dtype: the KV cache dtype.
      device_kind: e.g. "TPU v5 lite"; default: the first device's.
    Returns:
      A block_kv that divides `capacity`.
    """
    kind = _device_kind() if device_kind is None else device_kind
    name = jnp.dtype(dtype).name
    want = next((v for (k, d), v in TUNED_BLOCK_KV.items() if k in kind and d == name), 256)
    want = max(1, min(want, capacity))
    # Prefer multiples of 8 (sublane tiling) when one divides the capacity.
    for step in (8, 1):
        for bk in range(want - want % step or step, 0, -step):
            if capacity % bk == 0:
                return bk
    return 1


def pick_block_kv_gpu(capacity: int, head_dim: int) -> int:
    """block_kv of the Mosaic GPU kernel: 128 slots when 128 divides the capacity, else 64 (the
    kernel raises a clear error when 64 does not divide it either)."""
    del head_dim  # 64 and 128 both fit two K and two V tiles of 128 slots in shared memory
    return 128 if capacity % 128 == 0 else 64
