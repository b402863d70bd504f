"""Plain vs speculative `jspec.generate` at one batch size: ms per step / round, tokens/s, τ.

    python scripts/batch_speed.py BATCH [DRAFTER] [NEW] [PASSES]

DRAFTER: "ngram" (default) or a trained drafter's name; K = 3, bfloat16 target, greedy, the
first BATCH HumanEval prompts as one batch, NEW new tokens (96). PASSES (2) alternating passes of
(plain, speculative), each the median of 3 timed calls after a warm-up; compare the rows of
one pass (docs/BENCHMARKS.md "Where batch speculation stops paying").
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.prompts import load_prompt_set


def main() -> None:
    batch = int(sys.argv[1])
    name = sys.argv[2] if len(sys.argv) > 2 else "ngram"
    k = 3
    new = int(sys.argv[3]) if len(sys.argv) > 3 else 96
    passes = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    model = jspec.load_model("smollm2-135m", dtype="bfloat16")
    rows = [model.encode(r["text"]) for r in load_prompt_set(f"humaneval:0-{batch}")]
    ids = np.zeros((batch, max(map(len, rows))), np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    lens = jnp.asarray([len(r) for r in rows], jnp.int32)
    drafter = jspec.load_drafter(name, target=model)

    def run(**kw):
        out = jspec.generate(model, jnp.asarray(ids), lens, max_new_tokens=new, **kw)
        out.tokens.block_until_ready()
        return out

    for label, kw in [("plain", {}), ("spec", dict(drafter=drafter,
                                                    length=jspec.FixedLength(k)))] * passes:
        run(**kw)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            out = run(**kw)
            times.append(time.perf_counter() - t0)
        t = float(np.median(times))
        st = jax.device_get(out.stats)
        steps = int(np.max(st.rounds)) if label == "spec" else new
        tau = f", tau {np.sum(st.emitted) / max(1, np.sum(st.rounds)):.2f}" if label == "spec" else ""
        print(f"batch {batch} {label:5s} {name if label == 'spec' else '':>20s}: "
              f"{int(np.sum(out.lengths)) / t:6.1f} tokens/s, {t * 1e3 / steps:5.1f} ms/step{tau}",
              flush=True)


if __name__ == "__main__":
    main()
