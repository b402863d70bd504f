"""Greedy decoding's τ of a trained drafter on the held-out greedy answers, at several K, without
decoding (docs/BENCHMARKS.md, "Held-out τ that is decoding's τ").

    python scripts/replay_tau.py DRAFTER [--data runs/data] [--ks 1,2,3,4] [--new N]
                                 [--lookup M]
      DRAFTER: a trained drafter file or a shipped name, e.g. smollm2-135m-eagle3

Every held-out row of --data (its heldout_* feature shards: the target's greedy answers) goes
through the drafter once (`train.drafters.drafts_along`: the drafter's greedy draft from every
position, as decoding drafts it); `replay_rounds` then walks each row round by round as greedy
speculative decoding at K would (tested equal, row by row, to `jspec.generate`'s rounds).
Prints τ = tokens per round pooled over the rows, per K, for the whole set and per prompt set.
--new N: only each answer's first N tokens (the bench's --new-tokens). --lookup M: the drafter
wrapped as DRAFTER+ngram:n_min=M (`jspec.drafters.ngram.LookupFirst`, its own `NGram.lookup`
on the text before each round), next to the drafter alone. EAGLE-3 chains past its trained
length run on (as decoding at that K does); DFlash drafts at most its block - 1 tokens.
"""

import argparse
import dataclasses
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters.base import is_block_drafter
from jspec.drafters.loading import drafter_file, load_drafter
from jspec.drafters.ngram import NGram
from jspec.drafters.trained import Frozen, load_drafter_file, split_frozen
from jspec.models.model import load_model
from train.data import data_layers, load_rows, make_batch
from train.drafters import drafts_along, replay_rounds

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("drafter")
ap.add_argument("--data", default="runs/data")
ap.add_argument("--ks", default="1,2,3,4")
ap.add_argument("--new", type=int, default=0, help="first N answer tokens only (0: all)")
ap.add_argument("--lookup", type=int, default=0, help="also DRAFTER+ngram:n_min=M")
args = ap.parse_args()
path = drafter_file(args.drafter)
ks = [int(k) for k in args.ks.split(",")]
cfg, params, vocab = load_drafter_file(path)
kmax = max(ks)
model = load_model("smollm2-135m")
# What the drafter is, from its kind's registry entry (`jspec.drafters.kinds`, through
# `load_drafter`): a block drafter drafts at most a block; a chain drafter runs on.
loaded = load_drafter(str(path), target=model)
if not is_block_drafter(loaded):
    cfg = dataclasses.replace(cfg, block=max(kmax, cfg.block))
elif kmax > loaded.caps.block_tokens:
    raise SystemExit(f"error: a {cfg.kind} block drafts at most {loaded.caps.block_tokens} "
                     f"tokens, not K = {kmax}")
params, stats = split_frozen(params)
frozen = Frozen.of(model.weights.embed, vocab, stats)
to_draft = np.asarray(frozen.to_draft)
vocab = np.asarray(vocab)
recorded = data_layers(args.data)
cols = [recorded.index(i) for i in cfg.feature_layers]
feat_idx = list(range(len(cols)))
lookup = NGram(n_max=max(3, args.lookup), n_min=args.lookup) if args.lookup else None
variants = ["alone"] + ([f"+ngram:n_min={args.lookup}"] if lookup else [])


def looked_up(tokens: np.ndarray, k: int) -> np.ndarray:
    """i32[n, k] target ids: at each position q, `NGram.lookup`'s continuation of the text
    before q (-1: nothing found, or LookupFirst would keep the drafter's chain)."""
    width = -(-len(tokens) // 256) * 256  # a few compiles for the whole set
    seq = np.zeros((1, width), np.int32)
    seq[0, : len(tokens)] = tokens
    seq = jnp.asarray(seq)
    out = np.full((len(tokens), k), -1, np.int32)
    for q in range(1, len(tokens)):
        looked, found = _lookup(seq, jnp.asarray([q], jnp.int32), k)
        if bool(found[0]) and int(looked[0, 0]) >= 0:
            out[q] = np.asarray(looked[0])
    return out


_lookup = jax.jit(lambda seq, n, k: lookup.lookup(seq, n, k), static_argnums=2)


tot: dict[tuple[str, str], np.ndarray] = defaultdict(lambda: np.zeros((len(ks), 2), np.int64))
files = sorted(Path(args.data).glob("heldout_*.npz"))
for f in files:
    name = f.name.removeprefix("heldout_").split("-")[0]
    rows = load_rows(args.data, heldout=True, sets=[name], layers=cols)
    for i in range(len(rows)):
        tokens, p = rows.tokens[i], rows.plens[i]
        n = len(tokens) if not args.new else min(len(tokens), p + args.new)
        b = make_batch(rows, [i], -(-len(tokens) // 64) * 64, feat_idx)  # the whole row
        d = drafts_along(params, frozen, b, cfg)[0][:n]
        if lookup:  # target ids: a looked-up token may be outside the draft vocabulary
            ids = np.where(d >= 0, vocab[np.maximum(d, 0)], -1)
            found = looked_up(tokens[:n], d.shape[1])
            ids = np.where((found[:, :1] >= 0), found, ids)
        for j, k in enumerate(ks):
            for v in variants:
                if v == "alone":
                    e, r = replay_rounds(to_draft[tokens[:n]], d[:, :k], p + 1)
                else:
                    e, r = replay_rounds(tokens[:n], ids[:, :k], p + 1)
                tot[(name, v)][j] += (e, r)
                tot[("all", v)][j] += (e, r)
print(f"{path}: held-out greedy τ (tokens per round), {len(files)} shards"
      + (f", first {args.new} answer tokens" if args.new else ""))
print("| set | drafter | " + " | ".join(f"K = {k}" for k in ks) + " |")
print("|---" * (len(ks) + 2) + "|")
for (name, v), t in sorted(tot.items(), key=lambda x: (x[0][0] == "all", x[0])):
    print(f"| {name} | {v} | " + " | ".join(f"{e / max(r, 1):.3f}" for e, r in t) + " |")
