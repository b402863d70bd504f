"""Tokens/s of plain `jspec.generate` over the bench's 64 AlpacaEval prompts in batches of B.

    python scripts/generate_speed.py DTYPE BATCH [CAPACITY,...]     e.g. bfloat16 64 256,192

64 new tokens per row (EOS ignored), prefill included; each capacity (0: generate's own
choice) compiled first, then 3 passes alternated, medians printed. Run it with PYTHONPATH at
another checkout to compare code versions (docs/BENCHMARKS.md, issue 18).
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax.numpy as jnp
import numpy as np

from jspec import decode
from jspec.inputs import right_pad
from jspec.models.model import load_model
from jspec.prompts import load_prompt_set


def main(dtype: str, batch: int, caps: list[int | None]) -> None:
    model = load_model("smollm2-135m", dtype=dtype)
    model = dataclasses.replace(model, config=model.config.replace(eos_ids=()))
    enc = [model.encode(r["text"]) for r in load_prompt_set("alpaca:0-64")]
    batches = [right_pad(enc[i:i + batch]) for i in range(0, len(enc), batch)]

    def one_pass(cap: int | None) -> int:
        n = 0
        for ids, lens in batches:
            out = decode.generate(model, jnp.asarray(ids), jnp.asarray(lens), max_new_tokens=64,
                                  capacity=cap)
            n += int(np.asarray(out.lengths).sum())
        return n

    for c in caps:
        one_pass(c)  # compile
    speeds: dict[int | None, list[float]] = {c: [] for c in caps}
    for _ in range(3):
        for c in caps:
            t0 = time.perf_counter()
            n = one_pass(c)
            speeds[c].append(n / (time.perf_counter() - t0))
    for c in caps:
        print(f"{dtype} batch {batch} capacity {c or 'default'}: "
              f"{np.median(speeds[c]):.1f} tokens/s (passes {[round(s, 1) for s in speeds[c]]})")


if __name__ == "__main__":
    cs = [int(c) or None for c in sys.argv[3].split(",")] if len(sys.argv) > 3 else [None]
    main(sys.argv[1], int(sys.argv[2]), cs)
