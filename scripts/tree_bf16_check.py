"""The shipped EAGLE-3 as a top-k tree on the bfloat16 real target (HumanEval 0-1, 48 tokens,
K = 3): tree and chain τ, and where the tree's output first differs from bfloat16 greedy
decoding with the relative logit gap there (a near-tie when small; docs/BENCHMARKS.md).

    python scripts/tree_bf16_check.py
"""

import jax.numpy as jnp
import numpy as np

import jspec
from jspec.models.cache import KVCache
from jspec.models.llama import forward
from jspec.prompts import load_prompt_set

m = jspec.load_model("smollm2-135m").astype("bfloat16")
tree = jspec.load_drafter("smollm2-135m-eagle3+topk", target=m)
chain = jspec.load_drafter("smollm2-135m-eagle3", target=m)
for i, row in enumerate(load_prompt_set("humaneval:2")):
    ids = np.asarray([m.encode(row["text"])])
    ar = jspec.generate(m, ids, max_new_tokens=48)
    sp = jspec.generate(m, ids, max_new_tokens=48, drafter=tree, length=jspec.FixedLength(3))
    ch = jspec.generate(m, ids, max_new_tokens=48, drafter=chain, length=jspec.FixedLength(3))
    a, s = np.asarray(ar.tokens[0]), np.asarray(sp.tokens[0])
    line = (f"prompt {i}: tau tree {float(sp.stats.mean_accepted()[0]):.2f} chain "
            f"{float(ch.stats.mean_accepted()[0]):.2f}; ")
    if (a == s).all():
        print(line + "tree output identical to greedy decoding")
        continue
    j = int(np.argmax(a != s))
    seq = list(ids[0]) + list(a[:j])
    fo = forward(m.config, m.weights, jnp.asarray([seq], jnp.int32), jnp.arange(len(seq))[None],
                 KVCache.create(m.config, 1, len(seq) + 8))
    lg = np.asarray(fo.logits[0, -1], np.float64)
    gap = abs(lg[a[j]] - lg[s[j]]) / abs(lg.max())
    print(line + f"first difference at token {j}, relative logit gap {gap:.4f}")
