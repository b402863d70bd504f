"""The optimized HLO of the target's `forward`, source locations stripped, for comparing two
checkouts: `PYTHONPATH=A python scripts/forward_hlo.py DTYPE a.txt`, the same with B, then
`cmp a.txt b.txt` (identical text: the same compiled program, so the same speed).

Shapes: batch 1 x 1 and 4 new tokens, batch 16 x 4, 512 cache slots (no weights are read:
abstract shapes of SmolLM2-135M's).
"""

import re
import sys

import jax
import jax.numpy as jnp

import jspec
from jspec.models import KVCache, forward

m = jspec.load_model("smollm2-135m", dtype=sys.argv[1])
cfg = m.config
w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), m.weights)
out = []
for b, t in ((1, 1), (1, 4), (16, 4)):
    cache = jax.eval_shape(lambda b=b: KVCache.create(cfg, b, 512))
    f = jax.jit(lambda w, tok, pos, c: forward(cfg, w, tok, pos, c).logits)
    tok = jax.ShapeDtypeStruct((b, t), jnp.int32)
    txt = f.lower(w, tok, tok, cache).compile().as_text()
    txt = re.sub(r", metadata=\{[^}]*\}", "", txt)  # source locations
    txt = re.sub(r", stack_frame_id=[0-9]+", "", txt)
    txt = re.sub(r"%[\w.\-]+", "%x", txt)  # instruction names
    out.append("\n".join(ln for ln in txt.splitlines() if not re.match(r"^[0-9]+ ", ln)))
with open(sys.argv[2], "w") as fh:
    fh.write("\n".join(out))
print(f"{jspec.__file__}: {sum(len(o) for o in out)} characters -> {sys.argv[2]}")
