"""Before/after check of a refactor: autoregressive and EAGLE-3 K = 3 decoding, public API only
(so it runs on any checkout: `PYTHONPATH=/path/to/other/checkout python scripts/ab_round.py`).
`scripts/spec_speed.py` times the same two modes on 8 prompts without the first calls.

python scripts/ab_round.py DTYPE [PROMPTS]   (default humaneval:4, batch 1, 96 new tokens,
greedy). Prints one JSON line: per mode the first call (compile + run, s) and the median
tokens/s of 3 more calls over the prompts, and where jspec was imported from.
"""

import json
import sys
import time

import numpy as np

import jspec
from jspec.prompts import load_prompt_set

dtype = sys.argv[1]
spec = sys.argv[2] if len(sys.argv) > 2 else "humaneval:4"
m = jspec.load_model("smollm2-135m", dtype=dtype)
d = jspec.load_drafter("smollm2-135m-eagle3", target=m)
prompts = [np.asarray([m.encode(r["text"])], np.int32) for r in load_prompt_set(spec)]
width = -(-max(p.shape[1] for p in prompts) // 64) * 64


def run(drafter) -> tuple[float, int]:
    """Seconds and tokens for every prompt once (each padded to one width: one compile)."""
    t, n = time.perf_counter(), 0
    for p in prompts:
        ids = np.zeros((1, width), np.int32)
        ids[0, : p.shape[1]] = p[0]
        kw = {} if drafter is None else {"drafter": drafter, "length": jspec.FixedLength(3)}
        r = jspec.generate(m, ids, np.asarray([p.shape[1]], np.int32), max_new_tokens=96, **kw)
        n += int(np.asarray(r.lengths).sum())
    return time.perf_counter() - t, n


out = {"jspec": jspec.__file__, "dtype": dtype}
for name, drafter in (("ar", None), ("eagle3_k3", d)):
    t0 = time.perf_counter()
    run(drafter)
    first = time.perf_counter() - t0
    ts, ns = zip(*(run(drafter) for _ in range(3)), strict=True)
    out[name] = {"first_s": round(first, 2), "tok_s": round(ns[0] / float(np.median(ts)), 1)}
print(json.dumps(out), flush=True)
