"""Time of 30 `[M, 576] x [576, 1536]` products (SmolLM2-135M's MLP shape) per row count M,
float32 and bfloat16 (float32 accumulation), each chain jitted; median of 5 x 200 calls.

Shows why jspec computes a one-row bfloat16 product on CPU as two rows: XLA:CPU's one-row
bfloat16 matmul takes a slow path, its bfloat16 GEMM from two rows on a fast one.

    python scripts/cpu_matmul_rows.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

D, F, N = 576, 1536, 30


def chain_time(x: jax.Array, ws: list[jax.Array]) -> float:
    @jax.jit
    def f(x, ws):
        return sum(jnp.einsum("md,df->mf", x, w, preferred_element_type=jnp.float32).sum()
                   for w in ws)

    f(x, ws).block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(200):
            r = f(x, ws)
        r.block_until_ready()
        times.append((time.perf_counter() - t) / 200)
    return float(np.median(times))


rng = np.random.default_rng(0)
ws32 = [jnp.asarray(rng.standard_normal((D, F)), jnp.float32) for _ in range(N)]
ws16 = [w.astype(jnp.bfloat16) for w in ws32]
print(f"{N} products [M, {D}] x [{D}, {F}], ms per chain")
for m in (1, 2, 4, 8):
    x = jnp.asarray(rng.standard_normal((m, D)), jnp.float32)
    t32, t16 = chain_time(x, ws32), chain_time(x.astype(jnp.bfloat16), ws16)
    gbs = N * D * F * 4 / t32 / 1e9
    print(f"M={m}: float32 {1e3 * t32:.1f} ms ({gbs:.0f} GB/s of weights), "
          f"bfloat16 {1e3 * t16:.1f} ms")
