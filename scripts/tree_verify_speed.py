"""Time a tree's verification at T = 1 on one row: the walk (one target token drawn per node)
against recursive rejection sampling of a drawn tree (`verify_tree_drawn`), and one Gumbel draw
over the vocabulary alone. A 7-node tree of depth 3 with 2 children per node, V = 49,152 (the
SmolLM2 vocabulary), q over a 4,096-token draft vocabulary; jitted, median of 5 x 50 calls.
`python scripts/tree_verify_speed.py`"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from jspec.sampling import Sampling
from jspec.verify.tree import verify_tree

B, T, V, VD = 1, 7, 49_152, 4_096


def median_ms(f, key) -> float:
    jax.block_until_ready(f(key))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for j in range(50):
            r = f(jax.random.fold_in(key, j))
        jax.block_until_ready(r)
        times.append((time.perf_counter() - t0) / 50 * 1e3)
    return statistics.median(times)


def main() -> None:
    key = jax.random.key(0)
    logits = 3 * jax.random.normal(key, (B, T, V))
    tokens = jnp.asarray([[0, 5, 9, 7, 3, 11, 12]], jnp.int32)
    parents = jnp.asarray([[-1, 0, 0, 1, 1, 3, 3]], jnp.int32)
    depth = jnp.asarray([[0, 1, 1, 2, 2, 3, 3]], jnp.int32)
    valid = jnp.ones((B, T), bool)
    vocab = jnp.arange(VD, dtype=jnp.int32) * 3
    q = jax.nn.softmax(jax.random.normal(jax.random.key(1), (B, T, VD)), axis=-1)
    s = Sampling(temperature=1.0)
    walk = jax.jit(lambda k: verify_tree(k, tokens, parents, depth, valid, logits, s, 4))
    drawn = jax.jit(lambda k: verify_tree(k, tokens, parents, depth, valid, logits, s, 4, q=q,
                                          q_vocab=vocab, max_children=2))
    gumbel = jax.jit(lambda k: jax.random.gumbel(k, (1, V)))
    print(f"walk {median_ms(walk, key):.2f} ms, drawn (recursive rejection sampling) "
          f"{median_ms(drawn, key):.2f} ms, one Gumbel draw over V {median_ms(gumbel, key):.2f} ms")


if __name__ == "__main__":
    main()
