"""Memory of plain `generate` at batch 256 with 512 cache slots (issue 18's "within 8 GB"):

    python scripts/batch256_memory.py DTYPE plan   XLA's planned bytes (abstract weights: args +
                                                   outputs + temporaries), 128-wide prompts,
                                                   380 new tokens (fills the 512 slots)
    python scripts/batch256_memory.py DTYPE run    a real run: the first 256 AlpacaEval prompts
                                                   (cut to 128 tokens), 32 new tokens,
                                                   capacity 512; the process's peak RSS
"""

import dataclasses
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.prompts import load_prompt_set

dtype, mode = sys.argv[1], sys.argv[2]
m = jspec.load_model("smollm2-135m", dtype=dtype)
if mode == "plan":
    w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), m.weights)

    def run(w, ids, lens):
        target = dataclasses.replace(m, weights=w)
        return jspec.generate(target, ids, lens, max_new_tokens=380, capacity=512).tokens

    ids, lens = jax.ShapeDtypeStruct((256, 128), jnp.int32), jax.ShapeDtypeStruct((256,), jnp.int32)
    ma = jax.jit(run).lower(w, ids, lens).compile().memory_analysis()
    mib = {k: round(getattr(ma, f"{k}_size_in_bytes") / 2**20, 1) for k in ("argument", "output", "temp")}
    print(dtype, "planned MiB", mib, "total", round(sum(mib.values()), 1))
else:
    enc = [m.encode(r["text"])[:128] for r in load_prompt_set("alpaca:0-256")]
    ids = np.zeros((256, 128), np.int32)
    for i, e in enumerate(enc):
        ids[i, : len(e)] = e
    lens = np.asarray([len(e) for e in enc], np.int32)
    t = time.perf_counter()
    r = jspec.generate(m, ids, lens, max_new_tokens=32, capacity=512)
    n = int(np.asarray(r.lengths).sum())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(dtype, "tokens", n, "seconds (compile included)", round(time.perf_counter() - t, 1),
          "peak RSS GiB", round(rss, 2))
