"""Milliseconds of `jnp.argmax` next to `jspec.sampling.argmax` over B rows of 49,152 logits.

    python scripts/argmax_speed.py [B ...]        (default 1 4 16 64)

Median of 30 calls after a compile, both in the same run (docs/BENCHMARKS.md, issue 18).
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.sampling import argmax


def _ms(f, x) -> float:
    f(x).block_until_ready()
    ts = []
    for _ in range(30):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1000


if __name__ == "__main__":
    for b in [int(a) for a in sys.argv[1:]] or [1, 4, 16, 64]:
        x = jax.random.normal(jax.random.key(0), (b, 49152), jnp.float32)
        old, new = jax.jit(lambda x: jnp.argmax(x, -1)), jax.jit(argmax)
        assert np.array_equal(np.asarray(old(x)), np.asarray(new(x)))
        print(f"batch {b}: jnp.argmax {_ms(old, x):.3f} ms, jspec.sampling.argmax {_ms(new, x):.3f} ms")
