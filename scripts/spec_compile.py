"""Trace + lower and XLA compile time of a speculative `generate` (EAGLE-3, K = 3, batch 1,
192-token prompt buffer, 96 new tokens, abstract weights): `PYTHONPATH=A python
scripts/spec_compile.py DTYPE`; alternate checkouts, each a fresh process. Prints one JSON line.
"""

import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp

import jspec

m = jspec.load_model("smollm2-135m", dtype=sys.argv[1])
d = jspec.load_drafter("smollm2-135m-eagle3", target=m)
w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), m.weights)


def run(w, ids, lens):
    target = dataclasses.replace(m, weights=w)
    length = jspec.FixedLength(3)
    return jspec.generate(target, ids, lens, max_new_tokens=96, drafter=d, length=length).tokens


ids, lens = jax.ShapeDtypeStruct((1, 192), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
t0 = time.perf_counter()
lowered = jax.jit(run).lower(w, ids, lens)
t1 = time.perf_counter()
lowered.compile()
t2 = time.perf_counter()
out = {"jspec": jspec.__file__, "trace_lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2)}
print(json.dumps(out))
