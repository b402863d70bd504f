"""Speculative configurations against plain decoding, timed back to back per prompt.

On a shared host whose speed drifts over minutes, a bench that times one configuration over
all prompts and then the next compares rows measured at different times. Here every prompt is
decoded by every configuration in turn (the order rotating from prompt to prompt), once to
warm up and then once timed, so each configuration's tokens/s and its ratio to plain decoding
come from calls seconds apart. Batch 1, bfloat16 target, lossless. (`python -m jspec bench`
now times in the same order, compiling once per configuration instead of warming up on every
prompt; this script is what BENCHMARKS' paired tables of 2026-12-06 evening ran.)

    python scripts/paired_speed.py [--temperatures 0,1] [--prompts P] SPEC@K [SPEC@K ...]
    e.g. python scripts/paired_speed.py smollm2-135m-eagle3+ngram:look=4@2 \
        "smollm2-135m-eagle3+topk:k=3,nodes=6,width=2+ngram:look=4@3"

Prints a table per temperature (tokens/s, ratio to plain decoding over all prompts and per
prompt set, τ) and one JSON line per temperature.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.prompts import load_prompt_set


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("configs", nargs="+", help="drafter spec @ K")
    p.add_argument("--prompts", default="humaneval:0-8,gsm8k:0-8,mtbench:60-68")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    model = jspec.load_model("smollm2-135m", dtype=a.dtype)
    configs: list[tuple[str, dict]] = [("autoregressive", {})]
    for c in a.configs:
        spec, k = c.rsplit("@", 1)
        configs.append((c, dict(drafter=jspec.load_drafter(spec, target=model),
                                length=jspec.FixedLength(int(k)))))
    rows = []
    for part in a.prompts.split(","):
        rows += [(part, model.encode(r["text"])) for r in load_prompt_set(part)]
    sets = list(dict.fromkeys(s for s, _ in rows))
    for temp in (float(t) for t in a.temperatures.split(",")):
        sampling = jspec.Sampling(temperature=temp)
        sec = np.zeros((len(configs), len(rows)))
        tok = np.zeros_like(sec)
        rounds = np.zeros_like(sec)
        emitted = np.zeros_like(sec)
        for i, (_, ids) in enumerate(rows):
            x = jnp.asarray([ids])
            order = [(j + i) % len(configs) for j in range(len(configs))]
            for timed in (False, True):
                for j in order:
                    kw = configs[j][1]
                    key = jax.random.key(i)
                    t0 = time.perf_counter()
                    out = jspec.generate(model, x, max_new_tokens=a.new_tokens,
                                         sampling=sampling, key=key, **kw)
                    out.tokens.block_until_ready()
                    if timed:
                        sec[j, i] = time.perf_counter() - t0
                        tok[j, i] = int(np.asarray(out.lengths)[0])
                        rounds[j, i] = float(np.asarray(out.stats.rounds)[0])
                        emitted[j, i] = float(np.asarray(out.stats.emitted)[0])
            print(f"T={temp:g} prompt {i + 1}/{len(rows)}", flush=True)
        tps = tok.sum(1) / sec.sum(1)
        res = {"temperature": temp, "prompts": a.prompts, "rows": []}
        print(f"\nT = {temp:g}: {len(rows)} prompts, {a.new_tokens} new tokens, bfloat16, "
              f"batch 1, each prompt's calls back to back")
        print(f"{'configuration':64s} tok/s  vs AR  tau   " + "  ".join(sets))
        for j, (name, _) in enumerate(configs):
            per = []
            for s in sets:
                m = [i for i, (ps, _) in enumerate(rows) if ps == s]
                per.append(float(tok[j, m].sum() / sec[j, m].sum()
                                 / (tok[0, m].sum() / sec[0, m].sum())))
            tau = float(emitted[j].sum() / max(rounds[j].sum(), 1.0)) if j else 1.0
            print(f"{name:64s} {tps[j]:5.1f}  {tps[j] / tps[0]:.2f}x {tau:.2f}  "
                  + "  ".join(f"{r:.2f}x" for r in per))
            res["rows"].append({"config": name, "tokens_per_s": float(tps[j]),
                                "vs_ar": float(tps[j] / tps[0]), "tau": tau,
                                "vs_ar_by_set": dict(zip(sets, per, strict=True))})
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
