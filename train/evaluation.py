"""Held-out evaluation of a drafter run: `block_loss`'s metrics at sampled positions, and
`tau_replay`, the τ greedy decoding gets along the held-out greedy answers (`replay_rounds`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jspec import sharding
from jspec.drafters.trained import DrafterConfig, Frozen, Params, draft_logits, with_stats
from train.batches import positions, to_device
from train.data import Batch, make_batch
from train.recipes import RECIPES
from train.update import eval_step


@functools.partial(jax.jit, static_argnames=("kind", "cfg"))
def greedy_drafts(params: Params, frozen: Frozen, batch: Batch, pos: jax.Array,
                  *, kind: str, cfg: DrafterConfig) -> tuple[jax.Array, jax.Array]:
    """What greedy decoding drafts along a batch of text: for every position i32[B, M] of
    `pos` (a chain start / an anchor), (drafts i32[B, M, K], first i32[B, M]): the drafter's
    argmax draft-vocabulary indices for the K tokens from position `first` on, drafted from the
    text before them (the drafter's own outputs in between, as in decoding)."""
    params = with_stats(params, frozen.stats)
    hsel, tpos = RECIPES[kind].hidden(cfg, params, frozen.embed, batch.tokens,
                                      batch.feats.astype(jnp.float32), pos)
    drafts = jnp.argmax(draft_logits(cfg, params, frozen.head, hsel), axis=-1)
    return drafts.astype(jnp.int32), tpos[..., 0]


def replay_rounds(target: np.ndarray, drafts: np.ndarray, start: int) -> tuple[int, int]:
    """(tokens emitted, rounds) of greedy speculative decoding replayed along one row of the
    target's own greedy text.

    target: i32[n] the row's tokens as draft-vocabulary indices (-1 outside it: never
    accepted); drafts: i32[n, K] the drafter's K-token draft starting at each position (-1:
    none); start: the first position a round drafts (the one after the token sampled by the
    prefill). A round accepts the longest prefix of its draft that the text continues with and
    emits it plus one target token; the next round drafts from the position after them. On the
    target's greedy text this is exactly what greedy decoding does (the drafter sees the same
    text and features), so emitted / rounds is decoding's τ at K.
    """
    n, kk = len(target), drafts.shape[1]
    pos, rounds = start, 0
    while pos < n:
        a = 0
        while a < kk and pos + a < n and target[pos + a] >= 0 and drafts[pos, a] == target[pos + a]:
            a += 1
        rounds += 1
        pos += a + 1
    return max(n - start, 0), rounds


def drafts_along(params: Params, frozen: Frozen, b: Batch, cfg: DrafterConfig,
                 mesh: Mesh | None = None) -> np.ndarray:
    """i32[B, S, K] (host): `greedy_drafts` of a batch's rows indexed by the first drafted
    position (-1 where nothing is drafted from there)."""
    rows, s = b.tokens.shape
    chunk = RECIPES[cfg.kind].replay_chunk or s
    drafts = None
    for c in range(0, s, chunk):
        pos = np.minimum(np.arange(c, c + chunk, dtype=np.int32), s - 1)
        # Placed like the batch (rows over `data` on a mesh; every process holds all of it),
        # without what the drafts do not read.
        dev = to_device(mesh, dataclasses.replace(
            b, plens=None, final=None, valid=None, prefix=None,
            pos=np.ascontiguousarray(np.broadcast_to(pos, (rows, chunk)))))
        d, first = sharding.to_host(greedy_drafts(params, frozen, dev, dev.pos,
                                                  kind=cfg.kind, cfg=cfg))
        if drafts is None:
            drafts = np.full((rows, s, d.shape[-1]), -1, np.int32)
        ok = (first >= 0) & (first < s)
        r, m = np.nonzero(ok)
        drafts[r, first[r, m]] = d[r, m]
    return drafts


def replay_batch(params: Params, frozen: Frozen, b: Batch, cfg: DrafterConfig,
                 mesh: Mesh | None = None) -> tuple[int, int]:
    """(tokens emitted, rounds) of `replay_rounds` summed over a batch's rows."""
    tokens = b.tokens
    drafts = drafts_along(params, frozen, b, cfg, mesh)
    to_draft = np.asarray(frozen.to_draft)
    emitted = rounds = 0
    for i in range(len(tokens)):
        n, p = int(b.lens[i]), int(b.plens[i])  # p >= 1: drafts exist from p + 1 on
        e, r = replay_rounds(to_draft[tokens[i, :n]], drafts[i, :n], p + 1)
        emitted, rounds = emitted + e, rounds + r
    return emitted, rounds


def evaluate(args, rows, plan, feat_idx, cfg, params, frozen, mesh=None) -> dict[str, float]:
    """Held-out metrics: the means over `plan`'s batches of `block_loss`'s metrics at sampled
    positions, and `tau_replay` — greedy decoding's τ at K = the trained chain / block length,
    replayed along the held-out rows (`replay_rounds`; they are the target's greedy answers),
    pooled over them: tokens per round, as decoding counts it. (`tau_sim` averages 1 + accepted
    over uniformly sampled positions instead, so easy stretches, which decoding crosses in few
    rounds, weigh more: it reads higher than decoding's τ.)"""
    acc: dict[str, list[float]] = {}
    emitted = rounds = 0
    for j in range(len(plan)):
        seq, idx = plan[j]
        b = make_batch(rows, idx, seq, feat_idx)
        rng = np.random.default_rng([args.seed, 10**6 + j])
        b = b.at(*positions(args, cfg.kind, rng, b.lens, b.plens))
        m = eval_step(params, frozen, to_device(mesh, b), kind=cfg.kind, cfg=cfg)
        for k, v in m.items():
            acc.setdefault(k, []).append(float(v))
        e, r = replay_batch(params, frozen, b, cfg, mesh)
        emitted, rounds = emitted + e, rounds + r
    out = {k: float(np.mean(v)) for k, v in acc.items()}
    if rounds:
        out["tau_replay"] = emitted / rounds
    return out


