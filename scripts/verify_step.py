"""ms per target forward of T new tokens inside a `fori_loop` (cache carried, as in decoding),
for each way of writing the new K/V into the cache (docs/BENCHMARKS.md "Cache writes").

    python scripts/verify_step.py BATCH SLOTS T [DTYPE] [VARIANTS]

VARIANTS (comma-separated): current (jspec.models.cache.write_slots), one-select (one select
over the buffer for all T tokens, main before 2026-12-01 evening), scatter, window (a per-row
dynamic_update_slice). Median of 5 timed calls of 8 steps; cache filled to SLOTS / 2.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jspec
from jspec.models import cache as cache_mod
from jspec.models import llama
from jspec.models.cache import KVCache
from jspec.models.llama import Chain, forward


def one_select(buf, new, start):
    t = new.shape[1]
    rel = jnp.arange(buf.shape[2], dtype=jnp.int32)[None, :] - start[:, None]
    src = jnp.swapaxes(new, 1, 2).astype(buf.dtype)
    if t > 1:
        src = jnp.take_along_axis(src, jnp.clip(rel, 0, t - 1)[:, None, :, None], axis=2)
    return jnp.where(((rel >= 0) & (rel < t))[:, None, :, None], src, buf)


def scatter(buf, new, start):
    slots = start[:, None] + jnp.arange(new.shape[1], dtype=jnp.int32)[None, :]
    rows = jnp.arange(buf.shape[0], dtype=jnp.int32)[:, None]
    return buf.at[rows, :, slots].set(new.astype(buf.dtype), mode="drop")


def window(buf, new, start):
    src = jnp.swapaxes(new, 1, 2).astype(buf.dtype)
    for b in range(buf.shape[0]):
        buf = jax.lax.dynamic_update_slice(buf, src[b:b + 1], (b, 0, start[b], 0))
    return buf


VARIANTS = {"current": cache_mod.write_slots, "one-select": one_select, "scatter": scatter,
            "window": window}


def main() -> None:
    b, s, t = (int(a) for a in sys.argv[1:4])
    dtype = sys.argv[4] if len(sys.argv) > 4 else "bfloat16"
    names = (sys.argv[5] if len(sys.argv) > 5 else "current,one-select,scatter").split(",")
    model = jspec.load_model("smollm2-135m", dtype=dtype)
    cfg, n = model.config, 8

    def build(write):
        llama.write_slots = write  # the layer loop looks it up at trace time

        @jax.jit
        def loop(w, cache):
            def body(i, c):
                toks = jnp.full((b, t), 42, jnp.int32)
                pos = c.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
                return forward(cfg, w, toks, pos, c, mask=Chain()).cache.with_lengths(
                    c.lengths + 1)
            return jax.lax.fori_loop(0, n, body, cache)

        cache = KVCache.create(cfg, b, s).with_lengths(jnp.full((b,), s // 2, jnp.int32))
        jax.block_until_ready(loop(model.weights, cache))
        llama.write_slots = cache_mod.write_slots
        return loop, cache

    fns = {name: build(VARIANTS[name]) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(5):
        for name, (f, c) in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(model.weights, c))
            times[name].append((time.perf_counter() - t0) / n * 1e3)
    print(f"batch {b}, slots {s}, T {t}, {dtype}: "
          + ", ".join(f"{k} {statistics.median(v):.1f} ms" for k, v in times.items()))


if __name__ == "__main__":
    main()
