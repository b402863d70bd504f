"""Decoding rounds: each maps `SpecState -> SpecState` inside the jitted loop.

One skeleton for every speculative round (`speculative_round`): the length policy has the
drafter propose (`Proposal`: a chain, or a tree) -> one target forward over [last, nodes] at one
of the policy's static widths -> the verifier -> the accepted path's K/V written to contiguous
slots -> the drafter observes the path's target features -> commit. What differs between a
chain and a tree (mask, positions, acceptance, the path) is the proposal's `Topology`
(`jspec.topology`); each width returns a `Verified`. A fixed K, LibraSpec's per-row lengths,
n-gram's empty rounds (width 0: a one-token forward) and D²SD / top-k trees are all this
round. `autoregressive_round` is the round without a drafter; `make_round` picks, and
`run_rounds` loops it on the device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jspec.drafters.base import DraftContext, Drafter
from jspec.length import FixedLength, LibraSpec
from jspec.models.config import ModelConfig
from jspec.models.llama import Weights, forward
from jspec.sampling import Sampling, SamplingParams, sample_with_logprobs
from jspec.state import SpecState, commit, prefill
from jspec.state import features as features_of
from jspec.topology import Accepted, Topology
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


class Verified(NamedTuple):
    """One verify width's result (every width of a round returns this shape)."""

    accepted: Accepted  # what the verifier accepted, and the next token
    new_kv: tuple[jax.Array, ...]  # the block's K/V [L, B, t_max, KV, hd] (padded to t_max)
    feats: jax.Array  # f32[B, k+1, F, D] the drafter's target features along the path
    kept: jax.Array  # f32[B, k+1, D] the kept `features` along the path ([B, 0]: none)
    final: jax.Array  # f32[B, k+1, H] the final hidden states along the path ([B, 0]: none)


def speculative_round(config: ModelConfig, weights: Weights, drafter: Drafter, state: SpecState,
                      *, policy: LengthPolicy, sampling: Sampling, eos_ids: tuple[int, ...],
                      verifier: Verifier, features: tuple[int, ...] = ()) -> SpecState:
    """propose -> one target forward -> verify -> (move the path's K/V) -> observe -> commit.
    `features`: the layers whose hidden states the state keeps (the drafter's own, or any
    layers when it has none), `SpecState.features`. What depends on the proposal being a
    chain or a tree is asked of its `Topology`."""

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
        topo = Topology.of(prop, k)
        # -1: nothing proposed at that node. A finished row proposes nothing either, so
        # verifiers with running measurements (DIVERSED, ASD) leave it alone.
        valid = topo.verifiable(prop.valid & live[:, None], prop.tokens, state.stop,
                                state.limit - state.num_new)
        draft = jnp.where(valid, prop.tokens, 0)  # [B, N]
    b = draft.shape[0]
    m_emit = topo.emit_width(draft.shape[1])  # tokens a round can emit

    def verified(out, acc: Accepted) -> Verified:
        """The width's result: the accepted path's target features (the drafter's, the kept
        `features` and final hidden states), each a dummy when not needed."""
        none = jnp.zeros((b, 0), jnp.float32)
        mine = topo.along(features_of(out.hidden, caps.feature_norm), acc.path) if fl else none
        kept = final = none
        if features:
            kept = (mine if fl and caps.feature_norm == "rms"
                    else topo.along(feature_rows(out.hidden), acc.path))
            final = topo.along(out.final_hidden.astype(jnp.float32), acc.path)
        return Verified(acc, padded(out.new_kv), mine, kept, final)

    def verify_width(w):
        def plain(cache, vstate):
            # No row proposed anything: a one-token step (what a verify would compute with
            # every node rejected, at a fraction of the cost).
            with jax.named_scope("verify"):
                out = forward(config, weights, state.last[:, None], cache.lengths[:, None],
                              cache, hidden_layers=hl, write_cache=False)
            with jax.named_scope("accept"):
                nxt, lp = sample_with_logprobs(k_verify, out.logits[:, 0], sampling)
            return verified(out, topo.nothing_accepted(nxt, lp, verifier.plain_step(vstate),
                                                       m_emit))

        def run(cache, vstate):
            blk = topo.block(state.last, draft[:, :w], valid[:, :w], cache.lengths)
            with jax.named_scope("verify"):
                out = forward(config, weights, blk.tokens, blk.positions, cache, mask=blk.mask,
                              hidden_layers=hl, write_cache=False)
            with jax.named_scope("accept"):
                acc = topo.accept(blk, verifier, vstate, k_verify, prop, d, out.logits,
                                  out.final_hidden, sampling, oracle_pass=policy.oracle_pass,
                                  m_emit=m_emit)
            return verified(out, acc)
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
        res = branches[0](cache, state.verifier)
    else:  # the smallest static width the batch needs
        w_idx = jnp.sum(jnp.asarray(widths, jnp.int32) < need)
        res = jax.lax.switch(w_idx, branches, cache, state.verifier)
    acc = res.accepted
    n = acc.n
    with jax.named_scope("commit"):
        new_cache = cache.write(*topo.path_kv(res.new_kv, acc.path))
        if fl:
            dstate = drafter.observe(dstate, res.feats, cache.lengths, n + 1)
        emitted = jnp.concatenate([topo.path_tokens(draft, acc.path),
                                   jnp.zeros_like(acc.next_token)[:, None]], axis=1)
        emitted = emitted.at[jnp.arange(b), n].set(acc.next_token)
        # `drafted` counts the nodes each row proposed and the length policy put up for
        # verification (a chain: its first d; a tree: all), not the empty (-1) nodes of a
        # wider verify. Trees: no oracle length.
        kept = {} if not features else dict(feats=res.kept, final=res.final)
        state = commit(state, emitted, n + 1, state.stop, new_cache, n, acc.scored,
                       oracle=acc.oracle if topo.is_chain else None, logprobs=acc.logprobs,
                       **kept)
    return dataclasses.replace(state, key=key, drafter=dstate, verifier=acc.verifier)


def feature_rows(hidden: jax.Array) -> jax.Array:
    """The kept features (`SpecState.features`): RMS-normalised, as train/featurize writes."""
    return features_of(hidden, "rms")


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
