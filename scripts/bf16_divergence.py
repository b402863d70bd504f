"""Where greedy speculative decoding of the bfloat16 target departs from its greedy decoding.

Greedy verification commits exactly the verify pass's argmax, so a speculative output can only
differ from autoregressive decoding where the two passes compute different logits: a K+1-token
forward and a one-token forward round differently (other GEMM kernels, bfloat16 activations).
For each held-out HumanEval prompt (0-7, 96 new tokens), this decodes the bfloat16 target
greedily with and without the EAGLE-3 drafter (K=2), and at the first differing position prints
the two candidate tokens' logits from a teacher-forced bfloat16 forward of the shared prefix,
and from the float32 model: a gap of the size of bfloat16 rounding (~2^-8 of the logit) is a
near-tie that either pass may break either way.

    python scripts/bf16_divergence.py
"""

import jax.numpy as jnp
import numpy as np

import jspec
from jspec.models.cache import KVCache
from jspec.models.llama import forward
from jspec.prompts import load_prompt_set
from jspec.state import bucket_length

f32 = jspec.load_model("smollm2-135m")
bf = f32.astype("bfloat16")
drafter = jspec.load_drafter("smollm2-135m-eagle3", target=bf)
rows = load_prompt_set("humaneval:8")
enc = [bf.encode(r["text"]) for r in rows]
width = bucket_length(max(map(len, enc)))
gaps = []
for i, ids in enumerate(enc):
    padded = np.zeros((1, width), np.int32)
    padded[0, : len(ids)] = ids
    n = np.asarray([len(ids)], np.int32)
    outs = []
    for kw in ({}, {"drafter": drafter, "length": jspec.FixedLength(2)}):
        o = jspec.generate(bf, padded, n, max_new_tokens=96, **kw)
        outs.append([int(t) for t in np.asarray(o.tokens[0, : int(o.lengths[0])])])
    ar, sp = outs
    j = next((k for k, (a, b) in enumerate(zip(ar, sp, strict=False)) if a != b), None)
    if j is None:
        print(f"prompt {i}: identical ({len(ar)} tokens)")
        continue
    seq = ids + ar[:j]
    line = f"prompt {i}: first difference at new token {j}: AR {ar[j]} vs speculative {sp[j]};"
    for name, m in (("bfloat16", bf), ("float32", f32)):
        fo = forward(m.config, m.weights, jnp.asarray([seq]), jnp.arange(len(seq))[None],
                     KVCache.create(m.config, 1, len(seq) + 8))
        lg = np.asarray(fo.logits[0, -1], np.float64)
        top = lg.max()
        line += (f" {name} logits {lg[ar[j]]:.3f} / {lg[sp[j]]:.3f} (max {top:.3f},"
                 f" gap {abs(lg[ar[j]] - lg[sp[j]]):.3f})")
        if name == "bfloat16":
            gaps.append(abs(lg[ar[j]] - lg[sp[j]]) / max(abs(top), 1e-9))
    print(line)
print(f"{len(gaps)} of {len(enc)} outputs differ; relative logit gap at the first difference: "
      + ", ".join(f"{g:.4f}" for g in gaps) + f" (bfloat16 rounding: {2**-8:.4f})")
