"""Milliseconds per batched decode step of the real target (docs/BENCHMARKS.md, issue 18).

    python scripts/decode_step.py BATCH SLOTS DTYPE     e.g. 64 256 bfloat16

A KV cache of SLOTS slots filled to SLOTS / 2, 8 greedy one-token steps (`forward` + argmax,
the path of `generate`'s autoregressive round) in a `fori_loop`; median of 3 runs after a
compile, divided by 8. Run it with PYTHONPATH at another checkout to compare code versions.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jspec.sampling
from jspec.models.cache import KVCache
from jspec.models.llama import forward
from jspec.models.model import load_model

STEPS = 8
# generate's greedy pick; a checkout from before `jspec.sampling.argmax` (12ea97e and older)
# used jnp.argmax, so PYTHONPATH at one still runs its own decode path.
argmax = getattr(jspec.sampling, "argmax", lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))


def decode_loop(batch: int, slots: int, dtype: str) -> tuple[Any, tuple[Any, ...]]:
    """(jitted loop of STEPS greedy one-token steps, its arguments): the real target, a cache
    of `slots` slots filled to half, `forward` + `jspec.sampling.argmax` per step."""
    model = load_model("smollm2-135m", dtype=dtype)
    cfg = model.config
    cache = KVCache.create(cfg, batch, slots).with_lengths(jnp.full((batch,), slots // 2,
                                                                    jnp.int32))
    tok = jnp.ones((batch, 1), jnp.int32)

    @jax.jit
    def loop(w, cache, tok):
        def body(_, c):
            cache, tok = c
            o = forward(cfg, w, tok, cache.lengths[:, None], cache)
            return o.cache.with_lengths(cache.lengths + 1), argmax(o.logits[:, 0])[:, None]
        return jax.lax.fori_loop(0, STEPS, body, (cache, tok))

    return loop, (model.weights, cache, tok)


def main(batch: int, slots: int, dtype: str) -> float:
    loop, args = decode_loop(batch, slots, dtype)
    jax.block_until_ready(loop(*args))
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1000 / STEPS


if __name__ == "__main__":
    b, s, dt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    print(f"batch {b}, {s} slots, {dt}: {main(b, s, dt):.1f} ms per decode step")
