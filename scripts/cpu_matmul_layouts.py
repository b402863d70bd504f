"""Time of 30 float32 `[M, 576] x [576, 1536]` products (SmolLM2-135M's MLP shape) per row
count M, written five ways, each chain jitted; median of 7 calls (milliseconds).

Asks whether any way of writing a small-M product reads the weights once on XLA:CPU (so that
verifying 2-8 tokens costs about one decode step): dot, dot against a transposed [F, D] weight,
broadcast multiply-reduce (both layouts), and one matrix-vector product per row.

    python scripts/cpu_matmul_layouts.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

L, D, F = 30, 576, 1536


def chain(fn):
    @jax.jit
    def f(x, ws):
        return sum(fn(x, w).sum() for w in ws)

    return f


def main() -> None:
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((D, F), np.float32) * 0.02) for _ in range(L)]
    wts = [jnp.asarray(np.asarray(w).T.copy()) for w in ws]  # [F, D]
    variants = {
        "dot": (lambda x, w: x @ w, ws),
        "dot [F,D]": (lambda x, w: jnp.einsum("md,fd->mf", x, w), wts),
        "mul-sum": (lambda x, w: (x[:, :, None] * w[None]).sum(1), ws),
        "mul-sum [F,D]": (lambda x, w: (x[:, None, :] * w[None]).sum(-1), wts),
        "per row": (lambda x, w: jnp.concatenate([x[i:i + 1] @ w for i in range(x.shape[0])]),
                    ws),
    }
    print("M  " + "  ".join(f"{n:>13}" for n in variants))
    for m in (1, 2, 4, 8):
        x = jnp.asarray(rng.standard_normal((m, D), np.float32))
        row = []
        for fn, w in variants.values():
            f = chain(fn)
            f(x, w).block_until_ready()
            times = []
            for _ in range(7):
                t = time.perf_counter()
                f(x, w).block_until_ready()
                times.append(time.perf_counter() - t)
            row.append(f"{np.median(times) * 1e3:13.2f}")
        print(f"{m:<2} " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
