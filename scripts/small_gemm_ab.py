"""Target forward of T new tokens (batch 1, cache filled to FILL) with the CPU small-M GEMM
kernel (`jspec.models.cpu_gemm`) and with XLA's dot, timed interleaved in one process: median
ms per T and each arm's c(T) = t(T) / t(1) (docs/BENCHMARKS.md "Small-M products on the CPU").

    python scripts/small_gemm_ab.py [--sizes 1,2,3,4,6,8,12,16] [--fill 400] [--repeats 9]
                                    [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.models import cpu_gemm
from jspec.models.cache import KVCache
from jspec.models.llama import Chain, forward
from jspec.state import cache_capacity


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--fill", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    model = jspec.load_model("smollm2-135m", dtype=args.dtype)
    cfg = model.config
    cache = KVCache.create(cfg, 1, cache_capacity(args.fill, max(sizes))).with_lengths(
        jnp.array([args.fill], jnp.int32))

    def build(mode: str, t: int):
        os.environ[cpu_gemm.ENV] = mode  # read at trace time

        @jax.jit
        def fwd(w, toks, pos, cache):
            out = forward(cfg, w, toks, pos, cache, mask=Chain())
            return out.logits, out.cache

        toks = jnp.zeros((1, t), jnp.int32) + 42
        pos = jnp.asarray(args.fill + np.arange(t), jnp.int32)[None]
        jax.block_until_ready(fwd(model.weights, toks, pos, cache))
        return lambda: jax.block_until_ready(fwd(model.weights, toks, pos, cache))

    arms = {(m, t): build(m, t) for m in ("0", "1") for t in sizes}
    os.environ.pop(cpu_gemm.ENV)
    times: dict[tuple[str, int], list[float]] = {k: [] for k in arms}
    for _ in range(args.repeats):
        for k, f in arms.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    print(f"{args.dtype}, fill {args.fill}, median of {args.repeats} (ms; c = t(T)/t(1) of XLA)")
    print("T    XLA dot   kernel   c XLA  c kernel  kernel/XLA")
    for t in sizes:
        x, k = med[("0", t)], med[("1", t)]
        print(f"{t:<4} {x:8.1f} {k:8.1f}  {x / med[('0', 1)]:6.2f}  {k / med[('0', 1)]:8.2f}"
              f"  {k / x:10.2f}")


if __name__ == "__main__":
    main()
