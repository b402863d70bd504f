"""XLA's planned bytes of a speculative `generate` at a large batch (issue 18, "memory that
scales"): the shipped DFlash under LibraSpec (n = 4, d_max = 8), T = 1 (sampling: the drafter
carries its distributions q), 64-wide prompts, 64 new tokens, abstract weights (nothing runs).

    python scripts/draft_memory.py DTYPE BATCH [BATCH ...]     DTYPE: the target's

Run it with PYTHONPATH at another checkout to compare code versions.
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp

import jspec


def planned_mib(dtype: str, batch: int) -> dict[str, float]:
    m = jspec.load_model("smollm2-135m", dtype=dtype)
    d = jspec.load_drafter("smollm2-135m-dflash", target=m)
    length = jspec.LibraSpec(n=4, d_max=8)
    w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), m.weights)

    def run(w, ids, lens):
        target = dataclasses.replace(m, weights=w)
        return jspec.generate(target, ids, lens, max_new_tokens=64, drafter=d, length=length,
                              sampling=jspec.Sampling(temperature=1.0)).tokens

    ids = jax.ShapeDtypeStruct((batch, 64), jnp.int32)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    ma = jax.jit(run).lower(w, ids, lens).compile().memory_analysis()
    return {k: round(getattr(ma, f"{k}_size_in_bytes") / 2**20, 1)
            for k in ("argument", "output", "temp")}


if __name__ == "__main__":
    for b in map(int, sys.argv[2:]):
        mib = planned_mib(sys.argv[1], b)
        print(f"{sys.argv[1]} batch {b}: planned MiB {mib} total {round(sum(mib.values()), 1)}", flush=True)
