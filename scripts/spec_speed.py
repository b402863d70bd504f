"""Tokens/s of autoregressive and speculative `jspec.generate` on real prompts, one process.

For comparing two checkouts in one session (BENCHMARKS "One round skeleton"): run it
alternately with PYTHONPATH pointing at each. For each prompt one warm-up call, then one
timed call; tokens / summed seconds, batch 1.

  python scripts/spec_speed.py --label after --drafter smollm2-135m-eagle3 --k 3
"""

from __future__ import annotations

import argparse
import json
import time

import jax.numpy as jnp
import numpy as np

import jspec
from jspec.prompts import load_prompt_set


def tokens_per_s(model, rows, **kw) -> float:
    tok, sec = 0, 0.0
    for ids in rows:
        a = jnp.asarray([ids])
        jspec.generate(model, a, **kw).tokens.block_until_ready()
        t0 = time.perf_counter()
        out = jspec.generate(model, a, **kw)
        out.tokens.block_until_ready()
        sec += time.perf_counter() - t0
        tok += int(np.asarray(out.lengths)[0])
    return tok / sec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--label", default="")
    p.add_argument("--drafter", default="smollm2-135m-eagle3")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--prompts", default="humaneval:0-8")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    model = jspec.load_model("smollm2-135m", dtype=a.dtype)
    drafter = jspec.load_drafter(a.drafter, target=model)
    rows = [model.encode(r["text"]) for r in load_prompt_set(a.prompts)]
    res = {"label": a.label, "jspec": jspec.__file__,
           "autoregressive": tokens_per_s(model, rows, max_new_tokens=a.new_tokens),
           a.drafter: tokens_per_s(model, rows, max_new_tokens=a.new_tokens, drafter=drafter,
                                   length=jspec.FixedLength(a.k))}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
