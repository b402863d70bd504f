"""The optimized HLO of a whole autoregressive `generate` (batch 1, 192-token prompt buffer, 96 new
tokens, abstract weights), source locations stripped, for comparing two checkouts:
`PYTHONPATH=A python scripts/generate_hlo.py DTYPE a.txt`, the same with B, then `cmp a.txt b.txt`
(the source-file table is dropped).
"""

import dataclasses
import re
import sys

import jax
import jax.numpy as jnp

import jspec

m = jspec.load_model("smollm2-135m", dtype=sys.argv[1])
w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), m.weights)


def run(w, ids, lens):
    return jspec.generate(dataclasses.replace(m, weights=w), ids, lens, max_new_tokens=96).tokens


ids, lens = jax.ShapeDtypeStruct((1, 192), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
txt = jax.jit(run).lower(w, ids, lens).compile().as_text()
txt = re.sub(r", metadata=\{[^}]*\}", "", txt)  # source locations
txt = re.sub(r", stack_frame_id=[0-9]+", "", txt)
txt = re.sub(r"%[\w.\-]+", "%x", txt)  # instruction names
txt = "\n".join(ln for ln in txt.splitlines() if not re.match(r"^[0-9]+ ", ln))
with open(sys.argv[2], "w") as fh:
    fh.write(txt)
print(f"{jspec.__file__}: {len(txt)} characters -> {sys.argv[2]}")
