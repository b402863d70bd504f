"""Would fused QKV and gate/up weights pay? 30 layers' worth of the SmolLM2-135M projection GEMMs
(x [B, 576] against wq/wk/wv [576, 576/192/192] and w_gate/w_up [576, 1536] as five products,
or as two against the concatenated [576, 960] and [576, 3072]), through `blocks.dense` (so one
bfloat16 row takes the model's two-row path), in a `fori_loop`, median of 7 timed calls per arm,
interleaved: `python scripts/fused_gemm.py`. The weights are reused by every iteration (cache
resident), which favours compute: an upper bound on the gain at large batch.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models.blocks import dense

D, F, Q, KV = 576, 1536, 576, 192


def loop(x: jax.Array, mats: list[jax.Array]) -> jax.Array:
    def body(_, x):
        s = sum(dense(x, w).sum(-1, keepdims=True) for w in mats)
        return (x + s * 1e-9).astype(x.dtype)

    return jax.lax.fori_loop(0, 30, body, x)


def bench(b: int, dt: jnp.dtype) -> None:
    keys = jax.random.split(jax.random.key(0), 6)
    shapes = [(D, Q), (D, KV), (D, KV), (D, F), (D, F)]
    separate = [jax.random.normal(k, s, dt) for k, s in zip(keys, shapes, strict=False)]
    fused = [jnp.concatenate(separate[:3], 1), jnp.concatenate(separate[3:], 1)]
    x = jax.random.normal(keys[5], (b, D), dt)
    f = jax.jit(loop)
    times: dict[str, list[float]] = {"separate": [], "fused": []}
    for mats in (separate, fused):
        f(x, mats).block_until_ready()  # compile
    for _ in range(7):
        for name, mats in (("separate", separate), ("fused", fused)):
            t = time.perf_counter()
            f(x, mats).block_until_ready()
            times[name].append(time.perf_counter() - t)
    s, u = (float(np.median(times[n])) * 1e3 for n in ("separate", "fused"))
    print(f"batch {b} {jnp.dtype(dt).name}: separate {s:.2f} ms, fused {u:.2f} ms, "
          f"fused / separate {u / s:.2f}")


for dt in (jnp.bfloat16, jnp.float32):
    for b in (1, 4, 16, 64):
        bench(b, dt)
