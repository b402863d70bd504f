"""Decoding rounds: each maps `SpecState -> SpecState` inside the jitted loop.

One skeleton for every speculative round (`speculative_round`): the length policy has the
drafter propose (`Proposal`: a chain, or a tree) -> one target forward over [last, nodes] (chain
or tree mask) at one of the policy's static widths -> the verifier (`verify` for chains,
`verify_tree` for trees) -> the accepted path's K/V written to contiguous slots (a tree's
taken in depth order first: `path_kv`) -> the drafter observes the path's target features ->
commit. A fixed K, LibraSpec's per-row lengths, n-gram's empty rounds (width 0: a one-token
forward) and D²SD / top-k trees are all this round. `autoregressive_round` is the round
without a drafter; `make_round` picks, and `run_rounds` loops it on the device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters.base import DraftContext, Drafter
from jspec.length import FixedLength, LibraSpec
from jspec.models.config import ModelConfig
from jspec.models.llama import Chain, Tree, Weights, forward
from jspec.sampling import (
    Sampling,
    SamplingParams,
    dense_q,
    process_logits,
    processed_logprobs,
    sample_with_logprobs,
)
from jspec.state import SpecState, commit, is_eos, prefill
from jspec.state import features as features_of
from jspec.verify.base import Verifier

LengthPolicy = FixedLength | LibraSpec


def autoregressive_round(config: ModelConfig, weights: Weights, state: SpecState, *,
                         sampling: Sampling, eos_ids: tuple[int, ...],
                         features: tuple[int, ...] = ()) -> SpecState:
    """One target forward over `last`, one new token per unfinished row (`features`: the
    layers whose hidden states the state keeps, `SpecState.features`)."""
    sampling = sampling.with_rows(state.sampling)
    cache = state.cache
    with jax.named_scope("verify"):
        out = forward(config, weights, state.last[:, None], cache.lengths[:, None], cache,
                      hidden_layers=features)
    key, sub = jax.random.split(state.key)
    nxt, lp = sample_with_logprobs(sub, out.logits[:, 0], sampling)
    kept = {} if not features else dict(feats=feature_rows(out.hidden), final=out.final_hidden)
    with jax.named_scope("commit"):
        state = commit(state, nxt[:, None], jnp.ones_like(nxt), state.stop, out.cache,
                       jnp.zeros_like(nxt), 0, logprobs=lp[:, None], **kept)
    return dataclasses.replace(state, key=key)


def speculative_round(config: ModelConfig, weights: Weights, drafter: Drafter, state: SpecState,
                      *, policy: LengthPolicy, sampling: Sampling, eos_ids: tuple[int, ...],
                      verifier: Verifier, features: tuple[int, ...] = ()) -> SpecState:
    """propose -> one target forward -> verify -> (move the path's K/V) -> observe -> commit.
    `features`: the layers whose hidden states the state keeps (the drafter's own, or any
    layers when it has none), `SpecState.features`."""

    sampling = sampling.with_rows(state.sampling)  # per-row traced values, if any
    key, k_draft, k_verify = jax.random.split(state.key, 3)
    cache = state.cache
    live = ~state.done
    caps = drafter.caps
    fl = caps.feature_layers
    hl = fl or features  # the layers each target forward returns
    k = policy.draft_sizes(caps)[1]  # the longest path a round accepts (chain, tree depth)
    ctx = DraftContext(seq=state.seq, cache_len=cache.lengths, last=state.last)
    with jax.named_scope("draft"):
        prop, dstate, d, need = policy.draft(drafter, state.drafter, ctx, sampling, k_draft, live)
        # -1: nothing proposed at that node. A finished row proposes nothing either, so
        # verifiers with running measurements (DIVERSED, ASD) leave it alone.
        valid = prop.valid & live[:, None]
        if prop.is_chain:
            # Slots no commit can keep (past the first drafted EOS, or past max_new_tokens) are
            # not verified: the committed tokens are the same, and verifiers with running
            # measurements (DIVERSED, ASD) only see tokens that land in the output.
            j = jnp.arange(valid.shape[1], dtype=jnp.int32)[None]
            first_eos = jnp.min(jnp.where(is_eos(prop.tokens, state.stop) & valid, j,
                                          valid.shape[1]), axis=1)
            room = state.limit - state.num_new
            valid = valid & (j <= first_eos[:, None]) & (j < room[:, None])
        draft = jnp.where(valid, prop.tokens, 0)  # [B, N]
        depth = None if prop.is_chain else prop.depth()
    b = draft.shape[0]
    rows = jnp.arange(b)
    m_emit = (draft.shape[1] if prop.is_chain else k) + 1  # tokens a round can emit

    def emitted_logprobs(z, toks, n, nxt):
        """f32[B, m_emit]: log p of the emitted tokens (toks i32[B, t] with nxt at n, each
        chosen from processed logits z f32[B, t, V] at its own index), 0-padded past t. z is
        processed from the verify forward's whole logits, as the verifier processes them, so
        XLA computes that (top-p: a sort of the vocabulary) once."""
        toks = jnp.concatenate([toks, jnp.zeros_like(nxt)[:, None]], axis=1)[:, :z.shape[1]]
        lp = processed_logprobs(z, toks.at[rows, n].set(nxt))
        return jnp.pad(lp, ((0, 0), (0, m_emit - lp.shape[1])))

    def along(f, path):  # f32[B, T, ...] -> [B, k+1, ...] along the path (a chain: padded)
        if path is not None:
            return jnp.take_along_axis(f, path.reshape(*path.shape, *(1,) * (f.ndim - 2)), axis=1)
        return jnp.pad(f, ((0, 0), (0, k + 1 - f.shape[1])) + ((0, 0),) * (f.ndim - 2))

    def feats_of(out, path):
        """(the drafter's f32[B, k+1, F, D] target features along the path, the kept
        `features` and final hidden states there), each a dummy when not needed."""
        none = jnp.zeros((b, 0), jnp.float32)
        mine = along(features_of(out.hidden, caps.feature_norm), path) if fl else none
        if not features:
            return mine, none, none
        kept = mine if fl and caps.feature_norm == "rms" else along(feature_rows(out.hidden), path)
        return mine, kept, along(out.final_hidden.astype(jnp.float32), path)

    def verify_width(w):
        def plain(cache, vstate):
            # No row proposed anything: a one-token step (what a verify would compute with
            # every node rejected, at a fraction of the cost).
            with jax.named_scope("verify"):
                out = forward(config, weights, state.last[:, None], cache.lengths[:, None],
                              cache, hidden_layers=hl, write_cache=False)
            with jax.named_scope("accept"):
                nxt, lp = sample_with_logprobs(k_verify, out.logits[:, 0], sampling)
            n = jnp.zeros_like(nxt)
            path = None if prop.is_chain else jnp.zeros((b, k + 1), jnp.int32)
            lp = jnp.pad(lp[:, None], ((0, 0), (0, m_emit - 1)))
            return (n, nxt, padded(out.new_kv), verifier.plain_step(vstate),
                    feats_of(out, None), n, path, n, lp)

        def run(cache, vstate):
            dw, vw = draft[:, :w], valid[:, :w]
            toks = jnp.concatenate([state.last[:, None], dw], axis=1)  # [B, w+1]
            if prop.is_chain:
                pos = cache.lengths[:, None] + jnp.arange(w + 1, dtype=jnp.int32)[None]
                mask = Chain()
            else:  # node 0 is `last`, the root; drafted node t is node t + 1
                par = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), prop.parents[:, :w] + 1],
                                      axis=1)
                dep = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), depth[:, :w]], axis=1)
                pos = cache.lengths[:, None] + dep
                mask = Tree(par)
            with jax.named_scope("verify"):
                out = forward(config, weights, toks, pos, cache, mask=mask, hidden_layers=hl,
                              write_cache=False)
            with jax.named_scope("accept"):
                if prop.is_chain:
                    qw = None if prop.q is None else prop.q[:, :w]
                    chosen = vw & (jnp.arange(w)[None, :] < d[:, None])
                    kw = {}
                    if verifier.supports.compact_q:  # q stays in the drafter's vocabulary
                        kw["q_vocab"] = prop.q_vocab
                    elif qw is not None:
                        qw = dense_q(qw, prop.q_vocab, out.logits.shape[-1])
                    if verifier.supports.needs_hidden:  # DIVERSED context-level head
                        kw["hidden"] = (prop.hidden[:, :w], out.final_hidden[:, :w])
                    n, nxt, vstate = verifier.verify(vstate, k_verify, dw, qw, out.logits,
                                                     sampling, chosen, **kw)
                    # The oracle length: what the verifier would have accepted had every
                    # verified slot been proposed (greedy: a second, cheap argmax pass). When
                    # sampling it is observed only up to the row's own d (n; censored at d).
                    oracle = n
                    if policy.oracle_pass and sampling.greedy:
                        oracle, _, _ = verifier.verify(vstate, k_verify, dw, qw, out.logits,
                                                       sampling, vw, **kw)
                    path = None
                    scored = jnp.sum(prop.valid[:, :w] & (jnp.arange(w)[None, :] < d[:, None]),
                                     axis=1, dtype=jnp.int32)
                    lp = emitted_logprobs(process_logits(out.logits, sampling), dw, n, nxt)
                else:
                    ok = jnp.concatenate([jnp.ones((b, 1), bool), vw], axis=1)
                    kw = {}
                    if prop.q is not None:  # children drawn from q: row t + 1 is node t's
                        kw = dict(q=jnp.pad(prop.q[:, :w], ((0, 0), (1, 0), (0, 0))),
                                  q_vocab=prop.q_vocab, max_children=prop.branching)
                    n, path, nxt, vstate = verifier.verify_tree(
                        vstate, k_verify, toks, par, dep, ok, out.logits, sampling, k, **kw)
                    oracle = n
                    scored = jnp.sum(prop.valid[:, :w], axis=1, dtype=jnp.int32)
                    # The path's token at depth t + 1 was chosen from node path[:, t]'s logits.
                    at = jnp.clip(path, 0, w)
                    lp = emitted_logprobs(
                        jnp.take_along_axis(process_logits(out.logits, sampling),
                                            at[:, :, None], axis=1),
                        jnp.take_along_axis(dw, jnp.maximum(at[:, 1:] - 1, 0), axis=1), n, nxt)
            return (n, nxt, padded(out.new_kv), vstate, feats_of(out, path), oracle, path,
                    scored, lp)
        return plain if w == 0 else run

    widths = policy.verify_widths_for(caps)
    t_max = max(widths) + 1

    def padded(kv):  # the new K/V [L, B, w+1, KV, hd] of every width as t_max slots
        return tuple(jnp.pad(a, ((0, 0), (0, 0), (0, t_max - a.shape[2]), (0, 0), (0, 0)))
                     for a in kv)

    # Each width's forward leaves the cache unwritten and returns its new K/V; they are
    # written once, after the switch (a switch that returned the cache had XLA copy every
    # cache buffer into the loop carry each round).
    branches = [verify_width(w) for w in widths]
    if len(branches) == 1:
        n, nxt, new_kv, vstate, feats, oracle, path, scored, lp = branches[0](
            cache, state.verifier)
    else:  # the smallest static width the batch needs
        w_idx = jnp.sum(jnp.asarray(widths, jnp.int32) < need)
        n, nxt, new_kv, vstate, feats, oracle, path, scored, lp = jax.lax.switch(
            w_idx, branches, cache, state.verifier)
    with jax.named_scope("commit"):
        if prop.is_chain:
            path_tok = draft
        else:  # a tree: its path's K/V, in depth order, are what is written
            new_kv = path_kv(new_kv, path)
            path_tok = jnp.take_along_axis(draft, jnp.maximum(path[:, 1:] - 1, 0), axis=1)
        new_cache = cache.write(*new_kv)
        if fl:
            dstate = drafter.observe(dstate, feats[0], cache.lengths, n + 1)
        emitted = jnp.concatenate([path_tok, jnp.zeros_like(nxt)[:, None]], axis=1)
        emitted = emitted.at[rows, n].set(nxt)
        # `drafted` counts the nodes each row proposed and the length policy put up for
        # verification (a chain: its first d; a tree: all), not the empty (-1) nodes of a
        # wider verify. Trees: no oracle length.
        kept = {} if not features else dict(feats=feats[1], final=feats[2])
        state = commit(state, emitted, n + 1, state.stop, new_cache, n, scored,
                       oracle=oracle if prop.is_chain else None, logprobs=lp, **kept)
    return dataclasses.replace(state, key=key, drafter=dstate, verifier=vstate)


def feature_rows(hidden: jax.Array) -> jax.Array:
    """The kept features (`SpecState.features`): RMS-normalised, as train/featurize writes."""
    return features_of(hidden, "rms")


def path_kv(new_kv: tuple[jax.Array, ...], path: jax.Array) -> tuple[jax.Array, ...]:
    """The K/V of a tree's accepted path, in depth order: new_kv's arrays dtype[L, B, T, KV,
    hd] (node t at index t) -> dtype[L, B, D+1, KV, hd], index d the node path[:, d] (i32[B,
    D+1]). Written at slots lengths + 0..D, they commit the path (slots past the accepted
    length are scratch, as after a chain's verify)."""
    rows = jnp.arange(path.shape[0])[:, None]
    return tuple(a[:, rows, path] for a in new_kv)


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


def length_policy(k: int, length: LengthPolicy | None) -> LengthPolicy:
    """The policy a round runs: `length`, or a fixed `k`."""
    return FixedLength(k) if length is None else length


def make_round(config: ModelConfig, weights: Weights, drafter: Drafter | None, *, k: int,
               sampling: Sampling, eos_ids: tuple[int, ...], verifier: Verifier | None = None,
               length: LengthPolicy | None = None, features: tuple[int, ...] = ()) -> Any:
    """The round function `SpecState -> SpecState` for this drafter (None: autoregressive)
    and length policy (None / FixedLength: `k` drafts per round; LibraSpec: dynamic)."""

    if drafter is None:
        return functools.partial(autoregressive_round, config, weights, sampling=sampling,
                                 eos_ids=eos_ids, features=features)
    return functools.partial(speculative_round, config, weights, drafter,
                             policy=length_policy(k, length), sampling=sampling,
                             eos_ids=eos_ids, verifier=verifier, features=features)


def init_state(config: ModelConfig, weights: Weights, drafter: Drafter | None,
               prompt_ids: jax.Array, prompt_lengths: jax.Array, key: jax.Array, *,
               sampling: Sampling, max_new_tokens: int, capacity: int,
               eos_ids: tuple[int, ...], k: int, verifier: Verifier | None = None,
               length: LengthPolicy | None = None, limit: jax.Array | None = None,
               stop: jax.Array | None = None, sampling_params: SamplingParams | None = None,
               features: tuple[int, ...] = ()) -> SpecState:
    """Prefill the target (and the drafter) and sample the first new token; `limit` (i32[]
    or i32[B], dynamic) caps each row's new tokens below the static `max_new_tokens`; `stop`
    (i32[S], dynamic) replaces `eos_ids` as the stop ids the state carries (rounds read those);
    `sampling_params` (per-row traced values) likewise. `features`: the layers whose hidden
    states the state keeps for the output (the drafter's own, or any when it has none).

    `k` is the chain length (LibraSpec: d_max); the drafter's own proposal width is k, or one
    block under LibraSpec, and the longest path a round accepts k, or a proposer's longer
    chains (`draft_sizes`)."""

    caps = None if drafter is None else drafter.caps
    fl = () if caps is None else caps.feature_layers
    k_draft, width = (k, k) if caps is None else length_policy(k, length).draft_sizes(caps)
    state, out = prefill(config, weights, prompt_ids, prompt_lengths, key, sampling=sampling,
                         max_new_tokens=max_new_tokens, capacity=capacity, eos_ids=eos_ids,
                         draft_k=width, feature_layers=fl or features, limit=limit, stop=stop,
                         sampling_params=sampling_params, keep_features=bool(features))
    if drafter is not None:
        with jax.named_scope("draft_prefill"):
            feats = features_of(out.hidden, caps.feature_norm) if fl else None
            dstate = drafter.init_state(feats, prompt_ids, prompt_lengths, capacity, k=k_draft,
                                        verify_width=width)
        state = dataclasses.replace(state, drafter=dstate)
    if verifier is not None:
        state = dataclasses.replace(
            state, verifier=verifier.init_state(prompt_ids.shape[0], max_new_tokens))
    return state
