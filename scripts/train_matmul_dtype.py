"""Do bfloat16 matmuls make EAGLE-3 training faster on this CPU? (issue 19: measure.)

Times forward + backward of the drafter's GEMM chain at its training shapes (a 4,096-token
batch: fc [3·576 → 576], q/k/v/o, the MLP, the 4,096-row draft head), with float32 operands
against bfloat16 operands accumulated in float32 (`preferred_element_type`), interleaved,
median of 7. Usage: python scripts/train_matmul_dtype.py [TOKENS]
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

D, F, FFN, VD = 576, 3, 1536, 4096


def chain(ws, x, dtype):
    def mm(a, w):
        return jax.lax.dot_general(a.astype(dtype), w.astype(dtype), (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)

    h = mm(x, ws["fc"])
    a = mm(h, ws["wq"]) + mm(h, ws["wk"]) + mm(h, ws["wv"])
    h = h + mm(a, ws["wo"])
    g = mm(h, ws["gate"])
    h = h + mm(jax.nn.silu(g) * mm(h, ws["up"]), ws["down"])
    logits = mm(h, ws["head"])
    return jax.nn.logsumexp(logits, -1).mean()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    rng = np.random.default_rng(0)
    shapes = {"fc": (F * D, D), "wq": (D, D), "wk": (D, D), "wv": (D, D), "wo": (D, D),
              "gate": (D, FFN), "up": (D, FFN), "down": (FFN, D), "head": (D, VD)}
    ws = {k: jnp.asarray(rng.standard_normal(s, np.float32) * 0.02) for k, s in shapes.items()}
    x = jnp.asarray(rng.standard_normal((n, F * D), np.float32))
    fns = {dt.__name__: jax.jit(jax.grad(lambda w, x, dt=dt: chain(w, x, dt)))
           for dt in (jnp.float32, jnp.bfloat16)}
    times = {k: [] for k in fns}
    for f in fns.values():
        jax.block_until_ready(f(ws, x))
    for _ in range(7):
        for k, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(ws, x))
            times[k].append(time.perf_counter() - t)
    flops = 6 * n * sum(a * b for a, b in shapes.values())  # forward 2nk, backward 4nk
    for k, ts in times.items():
        m = float(np.median(ts))
        print(f"{k:9s} {m * 1e3:7.1f} ms  {flops / m / 1e9:6.1f} GFLOP/s")
    print(f"bfloat16 / float32 time: {np.median(times['bfloat16']) / np.median(times['float32']):.2f}")


if __name__ == "__main__":
    main()
