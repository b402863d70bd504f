"""The verify cost curve c(T): one timer for the bench, calibrate-length and tree budgets.

c(T) = t(target forward of T new tokens) / t(forward of 1), batch 1, `fill` tokens already in
the cache, measured on the model's own weights and dtype. The sizes are timed interleaved
(every size once per sweep, `repeats` sweeps, median per size), so drift in a shared machine's
speed does not land on one size.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec import platforms
from jspec.models.cache import KVCache
from jspec.models.llama import Chain, Tree, forward
from jspec.state import cache_capacity


def tree_depth(parents: np.ndarray) -> np.ndarray:
    """i32[T] depth of each node of a tree given by parents i32[T] (parents[t] < t, root -1)."""
    depth = np.zeros(len(parents), np.int32)
    for t, p in enumerate(parents):
        depth[t] = 0 if p < 0 else depth[p] + 1
    return depth


def filled_cache(model: Any, fill: int, capacity: int) -> KVCache:
    """A batch-1 cache of `capacity` slots with `fill` tokens in it (zeros: timing only)."""
    return KVCache.create(model.config, 1, capacity).with_lengths(jnp.array([fill], jnp.int32))


def forward_call(model: Any, t: int, fill: int, cache: KVCache,
                 parents: Any = None) -> Callable[[], Any]:
    """A compiled target forward of t new tokens after the `fill` tokens of a batch-1 `cache`
    (`filled_cache`; read, never written), as a call without arguments that returns once the
    result is ready.

    Compiled before it returns (what the compiler reads at trace time, e.g. the environment of
    `jspec.models.cpu_gemm`, is read now), so every call of it is a warm call to time.
    parents: optional i32[t] tree parents (node 0 the root, parent -1): the t new tokens then
    form that tree (`Tree` mask, positions fill + depth) instead of a chain.
    """
    cfg = model.config

    @jax.jit
    def fwd(w, toks, pos, cache, parents):
        out = forward(cfg, w, toks, pos, cache, mask=Chain() if parents is None else Tree(parents))
        return out.logits, out.cache

    parents = None if parents is None else jnp.asarray(parents, jnp.int32)
    depth = np.arange(t) if parents is None else tree_depth(np.asarray(parents))
    args = (jnp.zeros((1, t), jnp.int32) + 42, jnp.asarray(fill + depth, jnp.int32)[None], cache,
            parents)
    jax.block_until_ready(fwd(model.weights, *args))  # compile
    return lambda: jax.block_until_ready(fwd(model.weights, *args))


def forward_times(model: Any, sizes: list[int] | tuple[int, ...], fill: int, repeats: int,
                  parents_of: Callable[[int], Any] | None = None) -> dict[int, float]:
    """Median seconds per target forward of T new tokens for every T in `sizes`.

    parents_of: optional `T -> i32[T]` tree parents (node 0 the root, parent -1): the T new
    tokens then form that tree (`Tree` mask, positions fill + depth) instead of a chain.
    """
    sizes = sorted(set(sizes))
    # the capacity generate would give this fill
    cap = cache_capacity(fill, max(sizes), platform=platforms.of_arrays(model.weights))
    cache = filled_cache(model, fill, cap)
    calls = {t: forward_call(model, t, fill, cache, None if parents_of is None else parents_of(t))
             for t in sizes}
    times: dict[int, list[float]] = {t: [] for t in sizes}
    for _ in range(repeats):
        for t in sizes:
            t0 = time.perf_counter()
            calls[t]()
            times[t].append(time.perf_counter() - t0)
    return {t: statistics.median(v) for t, v in times.items()}


def cost_curve(model: Any, sizes: tuple[int, ...], fill: int, repeats: int,
               parents_of: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """{"ms": {T: ms}, "c": {T: t(T) / t(smallest T)}, "fill": fill} (`forward_times`)."""
    times = forward_times(model, sizes, fill, repeats, parents_of)
    first = min(times)
    return {"ms": {t: 1000 * s for t, s in times.items()},
            "c": {t: s / times[first] for t, s in times.items()}, "fill": fill}


def tree_cost(model: Any, drafter: Any, k: int, fill: int, repeats: int = 5) -> dict[str, Any]:
    """c(tree) of a tree drafter's proposal for chain length k: T = 1 + `caps.lookahead(k)`
    nodes under a `Tree` mask (the cost depends on T, not on the tree's shape)."""
    t = 1 + drafter.caps.lookahead(k)
    cc = cost_curve(model, (1, t), fill, repeats, parents_of=lambda n: np.arange(-1, n - 1))
    return {"nodes": t, "ms_1": cc["ms"][1], "ms_tree": cc["ms"][t], "c": cc["c"][t]}
