"""30 `[M, 576] x [576, 1536]` products (SmolLM2-135M's MLP shape) per row count M, written as
XLA's dot and through the CPU small-M kernel (`jspec.models.cpu_gemm`), float32 and bfloat16
weights, plus the tied LM head's `[M, 576] x [49152, 576]^T`; each chain jitted, the arms timed
interleaved, median of 7 (ms). docs/BENCHMARKS.md "Small-M products on the CPU".

    python scripts/small_gemm_chain.py [M ...]        (default 1 2 3 4 6 8 12 16 32)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models import cpu_gemm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_matmul_layouts import D, F, L, chain  # the same chain of products

V = 49152


def main() -> None:
    rows = [int(a) for a in sys.argv[1:]] or [1, 2, 3, 4, 6, 8, 12, 16, 32]
    assert cpu_gemm.available(), "the kernel could not be built here"
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((D, F), np.float32) * 0.02) for _ in range(L)]
    wb = [w.astype(jnp.bfloat16) for w in ws]
    emb = [jnp.asarray(rng.standard_normal((V, D), np.float32) * 0.02)]
    bf = jnp.bfloat16
    arms = {
        "XLA f32": (chain(lambda x, w: x @ w), ws),
        "XLA bf16": (chain(lambda x, w: jnp.einsum("md,df->mf", x.astype(bf), w,
                                                   preferred_element_type=jnp.float32)), wb),
        "kernel f32": (chain(lambda x, w: cpu_gemm.small_gemm(x, w)), ws),
        "kernel bf16": (chain(lambda x, w: cpu_gemm.small_gemm(x, w)), wb),
        "head XLA": (chain(lambda x, e: x @ e.T), emb),
        "head kernel": (chain(lambda x, e: cpu_gemm.small_gemm(x, e, True)), emb),
    }
    print("M   " + "".join(f"{n:>13}" for n in arms))
    for m in rows:
        x = jnp.asarray(rng.standard_normal((m, D), np.float32))
        times: dict[str, list[float]] = {n: [] for n in arms}
        for f, w in arms.values():
            jax.block_until_ready(f(x, w))
        for _ in range(7):
            for n, (f, w) in arms.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(x, w))
                times[n].append(time.perf_counter() - t0)
        print(f"{m:<4}" + "".join(f"{1e3 * statistics.median(v):13.2f}" for v in times.values()),
              flush=True)


if __name__ == "__main__":
    main()
