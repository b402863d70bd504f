"""`python -m jspec calibrate`: measure a drafter's best chain length, proposer and target dtype
here.

For each dtype: plain decoding and the drafter (alone and inside each of --proposers) at every
K on the same prompts (batch 1, greedy unless --temperature; per prompt every configuration in
turn, each one warm-up call then one timed call; tokens / summed seconds). The best is the
(dtype, proposer, K) with the most tokens/s; --save
writes it as the user's `jspec.defaults` record for this machine class, which `generate` then
uses when not told.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

import jspec
from jspec import defaults
from jspec.errors import JspecError
from jspec.prompts import load_prompt_set
from jspec.provenance import cpu_model, machine_class


def timed(model: Any, ids: list[int], max_new: int, sampling: jspec.Sampling, key: jax.Array,
          **kw: Any) -> tuple[int, float, int]:
    """(tokens, seconds, rounds) of one `generate` call after one warm-up call."""
    a = np.asarray([ids], np.int32)
    jspec.generate(model, a, max_new_tokens=max_new, sampling=sampling, key=key,
                   **kw).tokens.block_until_ready()
    t0 = time.perf_counter()
    out = jspec.generate(model, a, max_new_tokens=max_new, sampling=sampling, key=key, **kw)
    out.tokens.block_until_ready()
    sec = time.perf_counter() - t0
    return int(np.asarray(out.lengths)[0]), sec, int(np.asarray(out.stats.rounds)[0])


def batch_limit(faster: bool, prior: defaults.Record | None) -> int | None:
    """The `max_batch` a batch-1 calibration records. It settles batch 1 only: slower than plain
    decoding gives 0 (plain decoding at every batch); faster keeps the prior record's limit for
    the larger batches it measured (none, or a prior 0 it has just overturned: no limit)."""
    if not faster:
        return 0
    return prior.max_batch if prior is not None and prior.max_batch else None


def proposers_to_try(arg: str | None, drafter: str) -> list[str]:
    """--proposers as a list ("" for the drafter alone). Default: the drafter alone, and the
    proposer its current record names (so a re-measurement weighs the default it would
    replace)."""
    if arg is None:
        record = defaults.lookup(drafter)
        return [""] + ([record.proposer] if record is not None and record.proposer else [])
    out = ["" if p.strip() == "none" else p.strip() for p in arg.split(",") if p.strip()]
    if not out or any("+" in p for p in out):
        raise JspecError(f"--proposers: proposer specs separated by commas ('none' for the "
                         f"drafter alone), e.g. none,ngram; got {arg!r}")
    if "+" in drafter and out != [""]:
        raise JspecError(f"--drafter {drafter} names its proposer already: leave out --proposers")
    return list(dict.fromkeys(out))


def main(args: argparse.Namespace) -> int:
    try:
        ks = [int(x) for x in args.ks.split(",")]
    except ValueError:
        raise JspecError(f"--ks: integers separated by commas, got {args.ks!r}") from None
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in defaults.DTYPES]
    if bad or not dtypes:
        raise JspecError(f"--dtypes: each must be one of {defaults.DTYPES}, got {args.dtypes!r}")
    if any(not 1 <= k <= 64 for k in ks):
        raise JspecError(f"--ks must be in [1, 64], got {args.ks!r}")
    proposers = proposers_to_try(args.proposers, args.drafter)
    sampling = jspec.Sampling(temperature=args.temperature)
    rows_text = [r["text"] for r in load_prompt_set(args.prompts)]
    bar = tqdm(total=len(rows_text) * len(dtypes) * (len(proposers) * len(ks) + 1), unit="run",
               desc="calibrate", dynamic_ncols=True)
    # (dtype, proposer, k (0 = plain), tok/s, τ)
    results: list[tuple[str, str, int, float, float]] = []
    for dtype in dtypes:
        model = jspec.load_model(args.model, dtype=dtype)
        drafters = {p: jspec.load_drafter(args.drafter + (f"+{p}" if p else ""), target=model)
                    for p in proposers}
        configs = {("", 0): {}} | {(p, k): dict(drafter=d, length=jspec.FixedLength(k))
                                   for p, d in drafters.items() for k in ks}
        tot = {c: [0, 0.0, 0] for c in configs}
        # Interleaved: every configuration on a prompt before the next prompt, so a shared
        # machine's drift in speed does not land on one configuration.
        for i, text in enumerate(rows_text):
            ids = model.encode(text)
            for c, kw in configs.items():
                n, sec, rounds = timed(model, ids, args.max_new_tokens, sampling,
                                       jax.random.key(i), **kw)
                tot[c][0] += n
                tot[c][1] += sec
                tot[c][2] += rounds
                bar.update(1)
        results += [(dtype, p, k, n / sec, n / max(r, 1)) for (p, k), (n, sec, r) in tot.items()]
    bar.close()
    plain = max(r[3] for r in results if r[2] == 0)
    print(f"{'dtype':>9} {'proposer':>10} {'K':>3} {'tokens/s':>9} {'tau':>5} "
          f"{'vs best plain':>13}")
    for dtype, p, k, tps, tau in results:
        print(f"{dtype:>9} {(p or '-') if k else '':>10} {k or '-':>3} {tps:9.1f} {tau:5.2f} "
              f"{tps / plain:12.2f}x")
    dtype, proposer, k, tps, _ = max((r for r in results if r[2] > 0), key=lambda r: r[3])
    tried = ",".join(p or "none" for p in proposers)
    source = (f"python -m jspec calibrate --drafter {args.drafter} --proposers {tried} "
              f"--prompts {args.prompts} --ks {args.ks} --dtypes {args.dtypes} "
              f"--max-new-tokens {args.max_new_tokens} --temperature {args.temperature}: "
              f"{tps:.1f} tokens/s, {tps / plain:.2f}x the best plain decoding "
              f"({machine_class()} machine: {cpu_model()}, {os.cpu_count()} cores)")
    record = defaults.Record(k=k, dtype=dtype, source=source, proposer=proposer,
                             max_batch=batch_limit(tps >= plain, defaults.lookup(args.drafter)))
    best = args.drafter + (f"+{proposer}" if proposer else "")
    print(f"best on this {machine_class()} machine: {best} k={k} {dtype} ({tps / plain:.2f}x)")
    if tps < plain:
        print("note: no configuration beat plain decoding on this machine; the record says so "
              "(max_batch 0): given no --k / length=, `generate` with this drafter decodes "
              "plainly", flush=True)
    if args.save:
        print(f"saved to {defaults.save(args.drafter, record)}")
    return 0
