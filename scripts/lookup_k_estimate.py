"""An estimate before building it: should rounds where the n-gram lookup fires verify a longer
chain than the drafter's? (docs/BENCHMARKS.md, "The n-gram lookup by default").

    python scripts/lookup_k_estimate.py      # needs runs/data's held-out feature shards

Replays greedy decoding along the held-out greedy answers (first 96 answer tokens) with the
shipped EAGLE-3 drafting K_d tokens and, in rounds whose committed text ends in a repeated
n-gram (`smollm2-135m-eagle3+ngram`'s rule, n_min 2), the lookup's continuation of K_l tokens.
Prints τ, the share of lookup rounds and an *estimated* tokens/s: per round the verify cost of
K + 1 tokens from the small-M kernel's measured curve (BENCHMARKS "Small-M products on the
CPU", T = 5, 7, 9 interpolated) plus an assumed 8 + 3.5 K_d ms of drafting and bookkeeping
(roughly what the K = 2 rounds measured: 74-77 ms against a 60.5 ms verify).
"""
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters.loading import drafter_file
from jspec.drafters.ngram import NGram
from jspec.drafters.trained import Frozen, load_drafter_file, split_frozen
from jspec.models.model import load_model
from train.data import data_layers, load_rows, make_batch
from train.drafters import drafts_along

NEW = 96  # answer tokens per row (the bench's --new-tokens)
KL = 8  # longest looked-up chain tried
# Verify ms of T tokens (kernel row, "Small-M products on the CPU"; 5, 7, 9 interpolated).
VERIFY_MS = {1: 52.9, 2: 53.6, 3: 60.5, 4: 70.2, 5: 75.1, 6: 80.0, 7: 86.9, 8: 93.7, 9: 100.4}

path = drafter_file("smollm2-135m-eagle3")
cfg, params, vocab = load_drafter_file(path)
cfg = dataclasses.replace(cfg, block=max(4, cfg.block))
model = load_model("smollm2-135m")
params, stats = split_frozen(params)
frozen = Frozen.of(model.weights.embed, vocab, stats)
vocab = np.asarray(vocab)
recorded = data_layers("runs/data")
cols = [recorded.index(i) for i in cfg.feature_layers]
look = NGram(n_max=3, n_min=2)
_lookup = jax.jit(lambda seq, n, k: look.lookup(seq, n, k), static_argnums=2)


def row_drafts(rows, i):
    """(tokens i32[n], EAGLE-3's target-id drafts i32[n, 4], looked-up i32[n, KL], start)."""
    tokens, p = rows.tokens[i], rows.plens[i]
    n = min(len(tokens), p + NEW)
    b = make_batch(rows, [i], -(-len(tokens) // 64) * 64, list(range(len(cols))))
    d = drafts_along(params, frozen, b, cfg)[0][:n]
    ids = np.where(d >= 0, vocab[np.maximum(d, 0)], -1)
    seq = np.zeros((1, -(-len(tokens) // 256) * 256), np.int32)
    seq[0, : len(tokens)] = tokens
    seq = jnp.asarray(seq)
    lk = np.full((n, KL), -1, np.int32)
    for q in range(1, n):
        t, found = _lookup(seq, jnp.asarray([q], jnp.int32), KL)
        if bool(found[0]) and int(t[0, 0]) >= 0:
            lk[q] = np.asarray(t[0])
    return tokens[:n], ids, lk, p + 1


data = []
for f in sorted(Path("runs/data").glob("heldout_*.npz")):
    rows = load_rows("runs/data", heldout=True, sets=[f.name.removeprefix("heldout_").split("-")[0]],
                     layers=cols)
    data += [row_drafts(rows, i) for i in range(len(rows))]
    print(f.name, "done", file=sys.stderr)


def simulate(kd: int, kl: int) -> tuple[float, float, float]:
    """(τ, share of lookup rounds, estimated tokens/s) of greedy decoding along the answers."""
    emitted = rounds = looked = 0
    ms = 0.0
    for tok, ids, lk, start in data:
        n, pos = len(tok), start
        while pos < n:
            use = lk[pos, 0] >= 0
            draft, k = (lk[pos, :kl], kl) if use else (ids[pos, :kd], kd)
            a = 0
            while a < k and pos + a < n and draft[a] == tok[pos + a]:
                a += 1
            rounds, looked, pos = rounds + 1, looked + use, pos + a + 1
            ms += VERIFY_MS[k + 1] + 8 + 3.5 * kd
        emitted += max(n - start, 0)
    return emitted / rounds, looked / rounds, emitted / ms * 1000


print("| K_d | K_l | tau | lookup rounds | est. tokens/s |")
print("|---|---|---|---|---|")
for kd in (1, 2, 3):
    for kl in sorted({kd, 3, 4, 6, 8}):
        if kl >= kd:
            tau, share, tps = simulate(kd, kl)
            print(f"| {kd} | {kl} | {tau:.3f} | {share:.2f} | {tps:.1f} |")
