"""Tuning table for `relaxed_acceptance`: vocabulary entries per tile (`block_v`), rows per step.

Untuned: no accelerator has run this kernel yet (see docs/BENCHMARKS.md). The entries are
starting points (a [K+1, block_v] float32 tile of a few hundred KiB, a multiple of 128 lanes);
`python -m pallas_kernels.bench` on a device is how they should be replaced.
"""

from __future__ import annotations

from pallas_kernels import _platform

# device kind substring -> block_v. First match wins; "" matches all.
TUNED_BLOCK_V: dict[str, int] = {
    "TPU v5 lite": 4096,
    "TPU v6": 8192,
    "": 4096,
}


def pick_block_v(vocab: int, device_kind: str | None = None) -> int:
    """The tuned block_v for this device, never wider than the vocabulary rounded up to 128.

    Args:
      vocab: V.
      device_kind: e.g. "TPU v6e"; default: the first device's.
    Returns:
      block_v (a multiple of 128); the last tile may overhang V (the kernel masks it).
    """
    kind = _platform.device_kind() if device_kind is None else device_kind
    want = next(v for k, v in TUNED_BLOCK_V.items() if k in kind)
    return min(want, -(-vocab // 128) * 128)


# Rows per grid step: 1 on a device (the residual pass reads only position n's tiles); in
# interpret mode each grid step costs milliseconds, so take many rows at once.
INTERPRET_BLOCK_B = 256


def pick_block_b(batch: int, interpret: bool) -> int:
    """Rows per grid step: 1 on a device, else the largest divisor of `batch` <= INTERPRET_BLOCK_B."""
    if not interpret:
        return 1
    return next(d for d in range(min(batch, INTERPRET_BLOCK_B), 0, -1) if batch % d == 0)


def pick_block_v_gpu(vocab: int) -> int:
    """block_v of the Mosaic GPU kernels: 2048 entries (16 per thread of a warpgroup), shrunk to
    a multiple of 512 that fits in V."""
    return max(512, min(2048, vocab // 512 * 512))
