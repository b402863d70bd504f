"""Decoding rounds: each maps `SpecState -> SpecState` inside the jitted loop.

propose (drafter) -> one target forward over [last, drafts] -> verify -> commit. A fixed K runs
`speculative_round`, LibraSpec `libraspec_round` (per-row lengths), a tree drafter
`jspec.tree.tree_round`; `make_round` picks one and `run_rounds` loops it on the device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters.base import DraftContext
from jspec.length import LibraSpec, epsilon_star
from jspec.models.config import ModelConfig
from jspec.models.llama import Weights, forward
from jspec.sampling import Sampling, sample
from jspec.state import (
    SpecState,
    commit,
    drafter_may_abstain,
    feature_layers,
    features,
    prefill,
)
from jspec.tree import tree_round


def autoregressive_round(config: ModelConfig, weights: Weights, state: SpecState, *,
                         sampling: Sampling, eos_ids: tuple[int, ...]) -> SpecState:
    """One target forward over `last`, one new token per unfinished row."""
    cache = state.cache
    with jax.named_scope("verify"):
        out = forward(config, weights, state.last[:, None], cache.lengths[:, None], cache)
    key, sub = jax.random.split(state.key)
    nxt = sample(sub, out.logits[:, 0], sampling)
    with jax.named_scope("commit"):
        state = commit(state, nxt[:, None], jnp.ones_like(nxt), eos_ids, out.cache,
                       jnp.zeros_like(nxt), 0)
    return dataclasses.replace(state, key=key)


def speculative_round(config: ModelConfig, weights: Weights, drafter: Any, state: SpecState, *,
                      k: int, sampling: Sampling, eos_ids: tuple[int, ...],
                      verifier: Any) -> SpecState:
    """draft -> one target forward over [last, x_1..x_k] -> verify -> commit."""

    key, k_draft, k_verify = jax.random.split(state.key, 3)
    cache = state.cache
    ctx = DraftContext(seq=state.seq, cache_len=cache.lengths, last=state.last)
    with jax.named_scope("draft"):
        draft, q, dstate = drafter.propose(state.drafter, ctx, k, sampling, k_draft)
        # -1: the drafter has nothing to propose in that slot. A finished row proposes nothing
        # either, so verifiers with running measurements (DIVERSED, ASD) leave it alone.
        valid = (draft >= 0) & ~state.done[:, None]
        draft = jnp.where(valid, draft, 0)

    fl = feature_layers(drafter)

    def feats_of(out, t):  # f32[B, k+1, F, D] target features for the drafter (or a dummy)
        if not fl:
            return jnp.zeros((draft.shape[0], 0), jnp.float32)
        f = features(out.hidden, drafter)
        return jnp.pad(f, ((0, 0), (0, k + 1 - t), (0, 0), (0, 0)))

    def verify_block(cache, vstate):
        with jax.named_scope("verify"):
            toks = jnp.concatenate([state.last[:, None], draft], axis=1)  # [B, k+1]
            pos = cache.lengths[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None]
            out = forward(config, weights, toks, pos, cache, hidden_layers=fl)
        with jax.named_scope("accept"):
            kw = {}
            if verifier.supports.needs_hidden:  # DIVERSED context-level head
                kw["hidden"] = (dstate.hidden, out.final_hidden[:, :k])
            n, nxt, vstate = verifier.verify(vstate, k_verify, draft, q, out.logits, sampling,
                                             valid, **kw)
        return n, nxt, out.cache, vstate, feats_of(out, k + 1)

    def verify_none(cache, vstate):
        # No row proposed anything: a plain one-token step (what verify_block would compute,
        # with every slot rejected, at a fraction of the cost).
        with jax.named_scope("verify"):
            out = forward(config, weights, state.last[:, None], cache.lengths[:, None], cache,
                          hidden_layers=fl)
        with jax.named_scope("accept"):
            nxt = sample(k_verify, out.logits[:, 0], sampling)
        vstate = verifier.plain_step(vstate)  # keep the verifier's token count in step
        return jnp.zeros_like(nxt), nxt, out.cache, vstate, feats_of(out, 1)

    if drafter_may_abstain(drafter):
        n, nxt, new_cache, vstate, feats = jax.lax.cond(
            jnp.any(valid[:, 0] & ~state.done), verify_block, verify_none, cache,
            state.verifier)
    else:
        n, nxt, new_cache, vstate, feats = verify_block(cache, state.verifier)
    if fl:
        dstate = drafter.observe(dstate, feats, cache.lengths, n + 1)
    rows = jnp.arange(draft.shape[0])
    emitted = jnp.concatenate([draft, jnp.zeros_like(nxt)[:, None]], axis=1)
    emitted = emitted.at[rows, n].set(nxt)
    with jax.named_scope("commit"):
        # With every slot proposed, n is also the oracle length within k (statistics).
        state = commit(state, emitted, n + 1, eos_ids, new_cache, n, k, oracle=n)
    return dataclasses.replace(state, key=key, drafter=dstate, verifier=vstate)


def libraspec_round(config: ModelConfig, weights: Weights, drafter: Any, state: SpecState, *,
                    policy: Any, sampling: Sampling, eos_ids: tuple[int, ...],
                    verifier: Any) -> SpecState:
    """A round whose speculation length is chosen per row by LibraSpec (`jspec.length`).

    Draft min(n, b) tokens in a first block (b = drafter.block_tokens), then whole blocks of b
    until n are drafted; then, Algorithm 1 as a bounded
    fixed-point iteration: ε* over the first d confidences either cuts d (ε* ≤ d) or extends it
    to min(ε*, d_max), and a further block is drafted (`lax.cond`, only if a live row needs
    it). One target forward verifies [last, x_1..x_W] for W the smallest static width ≥ the
    largest live d (`lax.switch`); slots beyond a row's own d are empty, so the verifier
    rejects there and draws the token from the target (exact). At T > 0 the confidences are
    max-probabilities (fixed before each token is drawn) and a block anchored on a sampled
    token raises the row's floor to that token's slot (`raise_floor`): whether a slot is
    verified never depends on its own token, so sampling stays exact.
    """

    key, k_draft, k_verify = jax.random.split(state.key, 3)
    cache = state.cache
    live = ~state.done
    ctx = DraftContext(seq=state.seq, cache_len=cache.lengths, last=state.last)
    bs = drafter.block_tokens
    k1 = min(policy.n, bs)  # the first block drafts n tokens (at most a full block)
    n0 = 1 + -(-(policy.n - k1) // bs)  # blocks drafted before the first decision
    nb = 1 + -(-(policy.d_max - k1) // bs)  # most blocks a round may draft

    def end(j: int) -> int:  # drafted tokens once blocks 0..j exist
        return k1 + j * bs
    b = state.last.shape[0]
    keys = jax.random.split(k_draft, nb)

    with jax.named_scope("draft"):
        tok0, q0, dstate = drafter.propose(state.drafter, ctx, k1, sampling, keys[0])
        total = end(nb - 1)
        toks = jnp.zeros((b, total), jnp.int32).at[:, :k1].set(tok0)
        confs = jnp.zeros((b, total), jnp.float32).at[:, :k1].set(dstate.conf[:, :k1])
        qs = None if q0 is None else jnp.zeros((b, total, q0.shape[-1]), q0.dtype
                                                ).at[:, :k1].set(q0)

        def add_block(j, toks, confs, qs):
            lo = end(j - 1)
            anchor = jnp.maximum(toks[:, lo - 1], 0)
            t, q, c = drafter.extend(dstate, ctx, anchor, lo, sampling, keys[j])
            toks = toks.at[:, lo:lo + bs].set(t)
            confs = confs.at[:, lo:lo + bs].set(c)
            if qs is not None:
                qs = qs.at[:, lo:lo + bs].set(q)
            return toks, confs, qs

        for j in range(1, n0):
            toks, confs, qs = add_block(j, toks, confs, qs)
        # A drafted slot the drafter left empty (-1, e.g. a VAT cut) ends what can be accepted:
        # its confidence is 0 from there on.
        confs = jnp.where(jnp.cumsum(toks < 0, axis=1) > 0, 0.0, confs)
        def settle(c, have):
            """Iterate Algorithm 1 for every row whose next length is already drafted; a cut
            never goes below the row's floor."""
            def body(c):
                d, want, stop, floor, _, confs = c
                ready = ~stop & (want <= have)
                d = jnp.where(ready, want, d)
                eps = epsilon_star(confs, d, policy.alpha)
                cut = ready & (eps <= d)
                cap = ready & ~cut & (d >= policy.d_max)
                d = jnp.where(cut, jnp.maximum(eps, floor), d)
                want = jnp.where(ready & ~cut & ~cap, jnp.minimum(eps, policy.d_max),
                                 jnp.where(cut | cap, d, want))
                stop = stop | cut | cap
                return d, want, stop, floor, jnp.any(~stop & (want <= have)), confs

            d, want, stop, floor, _, _ = jax.lax.while_loop(
                lambda c: c[4], body, (*c, jnp.bool_(True), confs))
            return d, want, stop, floor

        def raise_floor(dws, j):
            """Exactness at T > 0 (ARCHITECTURE "LibraSpec at T > 0"): block j is anchored on
            the sampled token at slot end(j-1), so its confidences depend on that draw; once a
            row drafts it, the row's length is never cut below end(j-1) — whether slot s is
            verified then depends only on draws before s. Greedy tokens are not random: no
            floor."""
            if sampling.greedy:
                return dws
            d, want, stop, floor = dws
            return d, want, stop, jnp.where(stop, floor, end(j - 1))

        n_first = jnp.full((b,), policy.n, jnp.int32)
        dws = (n_first, n_first, ~live, jnp.zeros((b,), jnp.int32))  # (d, want, stop, floor)
        for j in range(1, n0):
            dws = raise_floor(dws, j)
        dws = settle(dws, end(n0 - 1))
        for j in range(n0, nb):
            need = jnp.any(~dws[2] & (dws[1] > end(j - 1)))  # a live row waits for block j
            toks, confs, qs = jax.lax.cond(
                need, lambda a, j=j: add_block(j, *a), lambda a: a, (toks, confs, qs))
            dws = settle(raise_floor(dws, j), end(j))
        d = dws[0]
        d = jnp.clip(d, 1, policy.d_max)
        valid_all = toks[:, :policy.d_max] >= 0
        draft = jnp.where(valid_all, toks[:, :policy.d_max], 0)
        q = None if qs is None else qs[:, :policy.d_max]

    fl = feature_layers(drafter)
    widths = policy.verify_widths
    d_live = jnp.max(jnp.where(live, d, 1))
    w_idx = jnp.sum(jnp.asarray(widths, jnp.int32) < d_live)

    def verify_width(w):
        def run(cache, vstate):
            dw, vw = draft[:, :w], valid_all[:, :w]
            qw = None if q is None else q[:, :w]
            with jax.named_scope("verify"):
                toks_in = jnp.concatenate([state.last[:, None], dw], axis=1)  # [B, w+1]
                pos = cache.lengths[:, None] + jnp.arange(w + 1, dtype=jnp.int32)[None]
                out = forward(config, weights, toks_in, pos, cache, hidden_layers=fl)
            with jax.named_scope("accept"):
                chosen = vw & (jnp.arange(w)[None, :] < d[:, None]) & live[:, None]
                n, nxt, vstate = verifier.verify(vstate, k_verify, dw, qw, out.logits, sampling,
                                                 chosen)
                # The oracle length: what the verifier would have accepted had every verified
                # slot been proposed (greedy: a second, cheap argmax pass). When sampling, it is
                # observed only up to the row's own d (n; censored at d, as for a fixed K).
                if sampling.greedy:
                    oracle, _, _ = verifier.verify(vstate, k_verify, dw, qw, out.logits,
                                                   sampling, vw)
                else:
                    oracle = n
            f = jnp.zeros((b, 0), jnp.float32)
            if fl:
                f = features(out.hidden, drafter)
                f = jnp.pad(f, ((0, 0), (0, policy.d_max + 1 - (w + 1)), (0, 0), (0, 0)))
            return n, nxt, out.cache, vstate, f, oracle
        return run

    n, nxt, new_cache, vstate, feats, oracle = jax.lax.switch(
        w_idx, [verify_width(w) for w in widths], cache, state.verifier)
    if fl:
        dstate = drafter.observe(dstate, feats, cache.lengths, n + 1)
    rows = jnp.arange(b)
    emitted = jnp.concatenate([draft, jnp.zeros_like(nxt)[:, None]], axis=1)
    emitted = emitted.at[rows, n].set(nxt)
    with jax.named_scope("commit"):
        state = commit(state, emitted, n + 1, eos_ids, new_cache, n, d, oracle=oracle)
    return dataclasses.replace(state, key=key, drafter=dstate, verifier=vstate)


def run_rounds(round_fn: Any, state: SpecState, max_rounds: int | jax.Array) -> SpecState:
    """`lax.while_loop` of `round_fn` until every row is done or `max_rounds` rounds ran."""
    def cond(c):
        s, i = c
        return (i < max_rounds) & ~jnp.all(s.done)

    def body(c):
        s, i = c
        return round_fn(s), i + 1

    state, _ = jax.lax.while_loop(cond, body, (state, jnp.int32(0)))
    return state


def make_round(config: ModelConfig, weights: Weights, drafter: Any, *, k: int,
               sampling: Sampling, eos_ids: tuple[int, ...], verifier: Any = None,
               length: Any = None) -> Any:
    """The round function `SpecState -> SpecState` for this drafter (None: autoregressive)
    and length policy (None / FixedLength: `k` drafts per round; LibraSpec: dynamic)."""

    if drafter is None:
        return functools.partial(autoregressive_round, config, weights, sampling=sampling,
                                 eos_ids=eos_ids)
    if isinstance(length, LibraSpec):
        return functools.partial(libraspec_round, config, weights, drafter, policy=length,
                                 sampling=sampling, eos_ids=eos_ids, verifier=verifier)
    if getattr(drafter, "is_tree", False):  # D²SD: a prefix tree per round (jspec/tree.py)
        return functools.partial(tree_round, config, weights, drafter, k=k, sampling=sampling,
                                 eos_ids=eos_ids, verifier=verifier)
    return functools.partial(speculative_round, config, weights, drafter, k=k, sampling=sampling,
                             eos_ids=eos_ids, verifier=verifier)


def init_state(config: ModelConfig, weights: Weights, drafter: Any, prompt_ids: jax.Array,
               prompt_lengths: jax.Array, key: jax.Array, *, sampling: Sampling,
               max_new_tokens: int, capacity: int, eos_ids: tuple[int, ...], k: int,
               verifier: Any = None, length: Any = None) -> SpecState:
    """Prefill the target (and the drafter) and sample the first new token.

    `k` is the most drafted tokens a round verifies (LibraSpec: d_max); the drafter's own
    proposal width is k, or one block under LibraSpec."""

    fl = feature_layers(drafter)
    state, out = prefill(config, weights, prompt_ids, prompt_lengths, key, sampling=sampling,
                         max_new_tokens=max_new_tokens, capacity=capacity, eos_ids=eos_ids,
                         draft_k=k, feature_layers=fl)
    if drafter is not None:
        with jax.named_scope("draft_prefill"):
            if fl and isinstance(length, LibraSpec):
                dstate = drafter.init_state(features(out.hidden, drafter), prompt_ids, prompt_lengths,
                                            capacity, k=min(length.n, drafter.block_tokens),
                                            verify_width=k)
            elif fl:
                dstate = drafter.init_state(features(out.hidden, drafter), prompt_ids, prompt_lengths,
                                            capacity, k=k)
            else:
                dstate = drafter.init_state(None, prompt_ids, prompt_lengths, capacity)
            state = dataclasses.replace(state, drafter=dstate)
    if verifier is not None:
        state = dataclasses.replace(
            state, verifier=verifier.init_state(prompt_ids.shape[0], max_new_tokens))
    return state
