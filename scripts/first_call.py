"""First-call (compile + run) and steady time of batched plain `generate` on real prompts.

python scripts/first_call.py DTYPE BATCH   (AlpacaEval prompts 0..BATCH-1, 64 new tokens,
greedy; prints the first call, the median of 3 more, and tokens/s counting each row's own
tokens)
"""

import sys
import time

import numpy as np

import jspec
from jspec.prompts import load_prompt_set

m = jspec.load_model("smollm2-135m", dtype=sys.argv[1])
b = int(sys.argv[2])
enc = [m.encode(r["text"]) for r in load_prompt_set(f"alpaca:0-{b}")]
w = -(-max(len(e) for e in enc) // 32) * 32
ids = np.zeros((b, w), np.int32)
lens = np.array([len(e) for e in enc], np.int32)
for i, e in enumerate(enc):
    ids[i, : len(e)] = e


def once() -> tuple[float, int]:
    t = time.perf_counter()
    r = jspec.generate(m, ids, lens, max_new_tokens=64)
    n = int(np.asarray(r.lengths).sum())
    return time.perf_counter() - t, n


first, _ = once()
ts, n = zip(*(once() for _ in range(3)), strict=True)
med = float(np.median(ts))
print(f"{sys.argv[1]} batch {b} width {w}: first call {first:.1f} s; median {med:.2f} s, "
      f"{n[0] / med:.1f} tokens/s")
