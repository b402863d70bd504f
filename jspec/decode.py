"""Decoding: the state carried between rounds, the round function and `generate`.

Static (changing these recompiles): the model config, `Sampling`, drafter/verifier/length
objects, `max_new_tokens`, the prompt-length bucket, the cache capacity and the mesh.
Dynamic: weights, prompt ids and lengths, the PRNG key.
Under a mesh (`jspec.sharding`), inputs are placed and the carried state is pinned to the
rules-table layout; the round functions themselves are the single-device code.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jspec import sharding
from jspec.errors import JspecError
from jspec.models.cache import KVCache
from jspec.models.config import ModelConfig
from jspec.models.llama import Weights, forward
from jspec.models.model import Model
from jspec.sampling import Sampling, sample

INVALID = -1  # the padding value of output token buffers


def bucket_length(n: int) -> int:
    """Prompt widths are padded to a few buckets so that shapes (and compiles) stay few."""
    if n <= 32:
        return 32
    if n <= 256:
        return -(-n // 32) * 32
    return -(-n // 128) * 128


def cache_capacity(prompt_width: int, max_new_tokens: int, lookahead: int = 0) -> int:
    """Slots needed for the prompt, the new tokens and a verify block of `lookahead` drafts."""
    need = prompt_width + max_new_tokens + lookahead + 1
    return -(-need // 128) * 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Stats:
    """Per-row decoding statistics (all i32)."""

    rounds: jax.Array  # i32[B] target verify passes after prefill
    emitted: jax.Array  # i32[B] tokens committed by those rounds (accepted + bonus/correction)
    accepted: jax.Array  # i32[B] drafted tokens accepted
    drafted: jax.Array  # i32[B] drafted tokens verified
    accepted_at: jax.Array  # i32[B, K] rounds in which draft position k was accepted
    # Σ over rounds of the oracle length (the longest drafted prefix the verifier would have
    # accepted, observed within the verified width, so a lower bound when it reaches that
    # width) and of |verified length − oracle length|. Under a fixed K the oracle is the
    # accepted count (exact for the lossless verifier; relaxed verifiers accept more).
    oracle: jax.Array  # i32[B]
    oracle_gap: jax.Array  # i32[B]

    @classmethod
    def zeros(cls, batch: int, k: int) -> Stats:
        z = jnp.zeros((batch,), jnp.int32)
        return cls(rounds=z, emitted=z, accepted=z, drafted=z,
                   accepted_at=jnp.zeros((batch, k), jnp.int32), oracle=z, oracle_gap=z)

    def mean_accepted(self) -> np.ndarray:
        """τ per row: tokens committed per round (accepted drafts + 1), host-side."""
        r = np.maximum(np.asarray(self.rounds), 1)
        return np.asarray(self.emitted) / r


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    """Everything a decoding round reads and writes. A pytree; donated between dispatches.

    Invariant: the target cache holds every committed token except `last`, which is the
    input of the next target forward.
    """

    cache: KVCache  # target KV cache; lengths i32[B]
    seq: jax.Array  # i32[B, C] prompt + committed tokens; seq[b, cache.lengths[b]] == last[b]
    tokens: jax.Array  # i32[B, N] generated tokens, INVALID-padded
    num_new: jax.Array  # i32[B] generated so far (including EOS)
    last: jax.Array  # i32[B] last committed token, not yet in the cache
    done: jax.Array  # bool[B] row finished (EOS or max_new_tokens)
    key: jax.Array  # PRNG key
    stats: Stats
    drafter: Any = None  # drafter state pytree (None for autoregressive decoding)
    verifier: Any = None  # verifier state pytree (e.g. ASD's regret budget)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GenerateOutput:
    tokens: jax.Array  # i32[B, N] new tokens, INVALID (-1) after each row's end
    lengths: jax.Array  # i32[B] new tokens per row (EOS included when emitted)
    stats: Stats
    verifier: Any = None  # the verifier's final state (e.g. ASD's remaining budget)


def _is_eos(tok: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    out = jnp.zeros(tok.shape, bool)
    for e in eos_ids:
        out = out | (tok == e)
    return out


def prefill(config: ModelConfig, weights: Weights, prompt_ids: jax.Array,
            prompt_lengths: jax.Array, key: jax.Array, *, sampling: Sampling,
            max_new_tokens: int, capacity: int, eos_ids: tuple[int, ...], draft_k: int = 0,
            feature_layers: tuple[int, ...] = ()) -> tuple[SpecState, Any]:
    """Run the prompt through the target and sample the first new token.

    Args:
      prompt_ids: i32[B, P] right-padded prompts. prompt_lengths: i32[B], 1 <= len <= P.
    Returns:
      (state, forward output of the prompt) — the latter lets drafters read target features.
    """
    b, p = prompt_ids.shape
    cache = KVCache.create(config, b, capacity)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    with jax.named_scope("prefill"):
        out = forward(config, weights, prompt_ids, positions, cache, compute_logits=False,
                      hidden_layers=feature_layers)
        last_h = jnp.take_along_axis(out.final_hidden, (prompt_lengths - 1)[:, None, None], axis=1)
        from jspec.models.llama import lm_logits  # noqa: PLC0415
        logits = lm_logits(config, weights, last_h[:, 0])  # [B, V]
    key, sub = jax.random.split(key)
    first = sample(sub, logits, sampling)
    tokens = jnp.full((b, max_new_tokens), INVALID, jnp.int32).at[:, 0].set(first)
    done = _is_eos(first, eos_ids) | (max_new_tokens <= 1)
    seq = jnp.zeros((b, capacity), jnp.int32).at[:, :p].set(prompt_ids)
    seq = seq.at[jnp.arange(b), prompt_lengths].set(first)
    state = SpecState(cache=out.cache.with_lengths(prompt_lengths), seq=seq, tokens=tokens,
                        num_new=jnp.ones((b,), jnp.int32), last=first, done=done, key=key,
                        stats=Stats.zeros(b, draft_k))
    return state, out


def commit(state: SpecState, emitted: jax.Array, n_emit: jax.Array, eos_ids: tuple[int, ...],
           cache: KVCache, n_accepted: jax.Array, n_drafted: int | jax.Array,
           oracle: jax.Array | None = None) -> SpecState:
    """Append up to `n_emit` tokens per live row, stop rows at EOS / max_new_tokens.

    Args:
      emitted: i32[B, M] this round's tokens (accepted drafts then the correction/bonus token).
      n_emit: i32[B] in [1, M] how many of them the verifier produced.
      cache: the target cache after the verify forward; its K/V for `last` and the first
        n_emit - 1 emitted tokens are valid, so committing is only a length update.
      n_accepted: i32[B] accepted drafted tokens (for statistics).
      n_drafted: drafted tokens verified (int, or i32[B] under LibraSpec).
      oracle: i32[B] or None: LibraSpec's oracle length this round (statistics).
    """
    b, m = emitted.shape
    n_max = state.tokens.shape[1]
    live = ~state.done
    j = jnp.arange(m, dtype=jnp.int32)[None, :]
    eos = _is_eos(emitted, eos_ids) & (j < n_emit[:, None])
    first_eos = jnp.min(jnp.where(eos, j, m), axis=1)
    count = jnp.minimum(jnp.minimum(n_emit, first_eos + 1), n_max - state.num_new)
    count = jnp.where(live, count, 0)
    keep = j < count[:, None]
    rows = jnp.arange(b)[:, None]
    out_slot = jnp.where(keep, state.num_new[:, None] + j, n_max)  # n_max: dropped
    tokens = state.tokens.at[rows, out_slot].set(emitted, mode="drop")
    seq_slot = jnp.where(keep, state.cache.lengths[:, None] + 1 + j, state.seq.shape[1])
    seq = state.seq.at[rows, seq_slot].set(emitted, mode="drop")
    num_new = state.num_new + count
    new_last = jnp.take_along_axis(emitted, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    hit_eos = live & (first_eos < count)
    done = state.done | hit_eos | (num_new >= n_max)
    k = state.stats.accepted_at.shape[1]
    acc = jnp.where(live, n_accepted, 0)
    stats = Stats(rounds=state.stats.rounds + live, emitted=state.stats.emitted + count,
                  accepted=state.stats.accepted + acc,
                  drafted=state.stats.drafted + live * n_drafted,
                  accepted_at=state.stats.accepted_at
                  + (jnp.arange(k)[None, :] < acc[:, None]).astype(jnp.int32),
                  oracle=state.stats.oracle, oracle_gap=state.stats.oracle_gap)
    if oracle is not None:
        stats.oracle = stats.oracle + jnp.where(live, oracle, 0)
        stats.oracle_gap = stats.oracle_gap + jnp.where(live, jnp.abs(n_drafted - oracle), 0)
    return dataclasses.replace(
        state, cache=cache.with_lengths(state.cache.lengths + count), seq=seq, tokens=tokens,
        num_new=num_new, last=jnp.where(count > 0, new_last, state.last), done=done, stats=stats)


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
    from jspec.drafters.base import DraftContext  # noqa: PLC0415

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
        f = features(out.hidden)
        return jnp.pad(f, ((0, 0), (0, k + 1 - t), (0, 0), (0, 0)))

    def verify_block(cache, vstate):
        with jax.named_scope("verify"):
            toks = jnp.concatenate([state.last[:, None], draft], axis=1)  # [B, k+1]
            pos = cache.lengths[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None]
            out = forward(config, weights, toks, pos, cache, hidden_layers=fl)
        with jax.named_scope("accept"):
            kw = {}
            if getattr(verifier, "needs_hidden", False):  # DIVERSED context-level head
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
        if hasattr(verifier, "plain_step"):  # keep the verifier's token count in step
            vstate = verifier.plain_step(vstate)
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
    from jspec.drafters.base import DraftContext  # noqa: PLC0415
    from jspec.length import epsilon_star  # noqa: PLC0415

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
                f = features(out.hidden)
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


def feature_layers(drafter: Any) -> tuple[int, ...]:
    """Target layers whose hidden states the drafter reads (trained drafters), else ()."""
    return tuple(getattr(drafter, "feature_layers", ()) or ())


def features(hidden: jax.Array) -> jax.Array:
    """[n, B, T, D] target hidden states -> f32[B, T, n, D], each vector divided by its RMS."""
    from jspec.drafters.trained import rms_normalize  # noqa: PLC0415

    return jnp.moveaxis(rms_normalize(hidden), 0, 2)


def drafter_may_abstain(drafter: Any) -> bool:
    """Drafters that may propose nothing (-1) for a whole batch get a cheap fallback branch."""
    return bool(getattr(drafter, "may_abstain", False))


def make_round(config: ModelConfig, weights: Weights, drafter: Any, *, k: int,
               sampling: Sampling, eos_ids: tuple[int, ...], verifier: Any = None,
               length: Any = None) -> Any:
    """The round function `SpecState -> SpecState` for this drafter (None: autoregressive)
    and length policy (None / FixedLength: `k` drafts per round; LibraSpec: dynamic)."""
    from jspec.length import LibraSpec  # noqa: PLC0415

    if drafter is None:
        return functools.partial(autoregressive_round, config, weights, sampling=sampling,
                                 eos_ids=eos_ids)
    if isinstance(length, LibraSpec):
        return functools.partial(libraspec_round, config, weights, drafter, policy=length,
                                 sampling=sampling, eos_ids=eos_ids, verifier=verifier)
    if getattr(drafter, "is_tree", False):  # D²SD: a prefix tree per round (jspec/tree.py)
        from jspec.tree import tree_round  # noqa: PLC0415
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
    from jspec.length import LibraSpec  # noqa: PLC0415

    fl = feature_layers(drafter)
    state, out = prefill(config, weights, prompt_ids, prompt_lengths, key, sampling=sampling,
                         max_new_tokens=max_new_tokens, capacity=capacity, eos_ids=eos_ids,
                         draft_k=k, feature_layers=fl)
    if drafter is not None:
        with jax.named_scope("draft_prefill"):
            if fl and isinstance(length, LibraSpec):
                dstate = drafter.init_state(features(out.hidden), prompt_ids, prompt_lengths,
                                            capacity, k=min(length.n, drafter.block_tokens),
                                            verify_width=k)
            elif fl:
                dstate = drafter.init_state(features(out.hidden), prompt_ids, prompt_lengths,
                                            capacity, k=k)
            else:
                dstate = drafter.init_state(None, prompt_ids, prompt_lengths, capacity)
            state = dataclasses.replace(state, drafter=dstate)
    if verifier is not None:
        state = dataclasses.replace(
            state, verifier=verifier.init_state(prompt_ids.shape[0], max_new_tokens))
    return state


# The verifier is a pytree argument (a learned DIVERSED head's arrays are leaves); Lossless and
# ASD are registered static pytrees, so their settings still key the compilation cache.
_STATIC = ("config", "sampling", "max_new_tokens", "capacity", "eos_ids", "k", "length",
           "mesh")


def _pin_inputs(mesh: Mesh | None, config: ModelConfig, weights: Weights, drafter: Any,
                verifier: Any, prompt_ids: jax.Array, prompt_lengths: jax.Array
                ) -> tuple[Any, ...]:
    """Under a mesh, constrain weights / drafter / verifier / prompts to their rule-table
    shardings (a verifier's arrays, e.g. a DIVERSED head, are replicated)."""
    if mesh is None:
        return weights, drafter, verifier, prompt_ids, prompt_lengths
    weights = sharding.constrain(weights, sharding.params_sharding(weights, mesh,
                                                                   head_dim=config.head_dim))
    if jax.tree.leaves(drafter):
        drafter = sharding.constrain(drafter, sharding.params_sharding(
            drafter, mesh, head_dim=sharding.head_dim_of(drafter)))
    if jax.tree.leaves(verifier):
        verifier = sharding.constrain(verifier, sharding.replicated(verifier, mesh))
    b = prompt_ids.shape[0]
    prompt_ids, prompt_lengths = sharding.constrain(
        (prompt_ids, prompt_lengths),
        sharding.state_sharding((prompt_ids, prompt_lengths), mesh, batch=b))
    return weights, drafter, verifier, prompt_ids, prompt_lengths


def _pin_state(mesh: Mesh | None, state: SpecState) -> SpecState:
    """Under a mesh, keep the carried state in its rule-table layout (batch rows over `data`,
    cache KV heads over `model`) from round to round."""
    if mesh is None:
        return state
    return sharding.constrain(state, sharding.state_sharding(state, mesh,
                                                             batch=state.last.shape[0]))


def _pinned_round(mesh: Mesh | None, round_fn: Any) -> Any:
    if mesh is None:
        return round_fn
    return lambda s: _pin_state(mesh, round_fn(s))


@functools.partial(jax.jit, static_argnames=_STATIC)
def _generate(weights: Weights, drafter: Any, verifier: Any, prompt_ids: jax.Array,
              prompt_lengths: jax.Array, key: jax.Array, *, config: ModelConfig,
              sampling: Sampling, max_new_tokens: int, capacity: int,
              eos_ids: tuple[int, ...], k: int, length: Any = None,
              mesh: Mesh | None = None) -> GenerateOutput:
    weights, drafter, verifier, prompt_ids, prompt_lengths = _pin_inputs(
        mesh, config, weights, drafter, verifier, prompt_ids, prompt_lengths)
    state = init_state(config, weights, drafter, prompt_ids, prompt_lengths, key,
                       sampling=sampling, max_new_tokens=max_new_tokens, capacity=capacity,
                       eos_ids=eos_ids, k=k, verifier=verifier, length=length)
    state = _pin_state(mesh, state)
    round_fn = make_round(config, weights, drafter, k=k, sampling=sampling, eos_ids=eos_ids,
                          verifier=verifier, length=length)
    state = run_rounds(_pinned_round(mesh, round_fn), state, max_new_tokens - 1)
    return GenerateOutput(tokens=state.tokens, lengths=state.num_new, stats=state.stats,
                          verifier=state.verifier)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _init_jit(weights: Weights, drafter: Any, verifier: Any, prompt_ids: jax.Array,
              prompt_lengths: jax.Array, key: jax.Array, **statics: Any) -> SpecState:
    mesh = statics.pop("mesh", None)
    weights, drafter, verifier, prompt_ids, prompt_lengths = _pin_inputs(
        mesh, statics["config"], weights, drafter, verifier, prompt_ids, prompt_lengths)
    state = init_state(statics["config"], weights, drafter, prompt_ids, prompt_lengths, key,
                       verifier=verifier, **{k: v for k, v in statics.items() if k != "config"})
    return _pin_state(mesh, state)


@functools.partial(jax.jit, static_argnames=("config", "sampling", "eos_ids", "k", "length",
                                             "rounds", "mesh"),
                   donate_argnames=("state",))
def _chunk_jit(weights: Weights, drafter: Any, verifier: Any, state: SpecState, *,
               config: ModelConfig, sampling: Sampling, eos_ids: tuple[int, ...], k: int,
               rounds: int, length: Any = None, mesh: Mesh | None = None) -> SpecState:
    round_fn = make_round(config, weights, drafter, k=k, sampling=sampling, eos_ids=eos_ids,
                          verifier=verifier, length=length)
    return run_rounds(_pinned_round(mesh, round_fn), state, rounds)


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


PADDING_SIDES = ("right", "left")


def validate_prompts(model: Model, prompt_ids: Any, prompt_lengths: Any, max_new_tokens: int,
                     capacity: int | None, *, attention_mask: Any = None,
                     padding_side: str = "right") -> tuple[jax.Array, jax.Array]:
    """Check shapes always and values when concrete; return jspec's right-padded layout.

    Args:
      model: the target (its vocabulary, context length and `pad_id` are read).
      prompt_ids: i32[B, P] (or i32[P]) prompt ids, padded on `padding_side`.
      prompt_lengths: i32[B] real lengths, or None (with no `attention_mask`: all P).
      max_new_tokens: new tokens per row.
      capacity: the cache capacity asked for, or None.
      attention_mask: i32|bool[B, P] (or [P]) 1 on real tokens, an alternative to
        `prompt_lengths` (lengths are its row sums).
      padding_side: "right" (jspec's layout) or "left" (Hugging Face's: real tokens last).
    Returns:
      (ids i32[B, P] right-padded, zeros after each row's length; lengths i32[B]). Left-padded
      rows are moved to the front with a per-row gather, which also works on traced ids.
    """
    if padding_side not in PADDING_SIDES:
        raise JspecError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise JspecError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    ids = jnp.asarray(prompt_ids) if _is_concrete(prompt_ids) else prompt_ids
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise JspecError(f"prompt_ids must be int32[B, P], got shape {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise JspecError(f"prompt_ids must be integers, got {ids.dtype}")
    b, p = ids.shape
    if p == 0:
        raise JspecError("the prompt is empty")
    if attention_mask is not None and prompt_lengths is not None:
        raise JspecError("pass prompt_lengths or attention_mask, not both")
    if attention_mask is not None:
        lengths = _mask_lengths(attention_mask, b, p, padding_side)
    elif prompt_lengths is None:
        lengths = jnp.full((b,), p, jnp.int32)
    else:
        lengths = jnp.asarray(prompt_lengths, jnp.int32).reshape(-1) \
            if _is_concrete(prompt_lengths) else prompt_lengths.astype(jnp.int32).reshape(-1)
        if lengths.shape != (b,):
            raise JspecError(f"prompt_lengths must be int32[{b}], got shape {lengths.shape}")
    if _is_concrete(ids) and _is_concrete(lengths):
        ln = np.asarray(lengths)
        if (ln < 1).any():
            raise JspecError("the prompt is empty (a prompt length is < 1)")
        if (ln > p).any():
            raise JspecError(f"a prompt length exceeds the prompt width {p}")
        arr = np.asarray(ids)
        cols = np.arange(p)[None, :]
        valid = cols < ln[:, None] if padding_side == "right" else cols >= p - ln[:, None]
        bad = valid & ((arr < 0) | (arr >= model.config.vocab_size))
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise JspecError(f"token id {int(arr[r, c])} at row {r}, position {c} is outside the "
                             f"vocabulary [0, {model.config.vocab_size})")
        if model.pad_id is not None:
            if prompt_lengths is None and attention_mask is None:
                _check_unmarked_padding(arr, model.pad_id)
            else:
                _check_padding_side(arr, ln, model.pad_id, padding_side,
                                    pad_is_bos=model.pad_id == model.config.bos_id)
        longest = int(ln.max())
    else:
        longest = p
    limit = model.config.max_position
    if longest + max_new_tokens > limit:
        raise JspecError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"the model's context length {limit}")
    if capacity is not None and capacity < p + max_new_tokens + 1:
        raise JspecError(f"prompt width {p} + max_new_tokens {max_new_tokens} does not fit the "
                         f"cache capacity {capacity}")
    ids = ids.astype(jnp.int32)
    if padding_side == "left" and (prompt_lengths is not None or attention_mask is not None):
        ids = left_to_right_padded(ids, lengths)
    return ids, lengths


def _mask_lengths(attention_mask: Any, b: int, p: int, padding_side: str) -> jax.Array:
    """i32[B] row sums of an HF-style attention mask i32|bool[B, P]; when concrete, also check
    that each row's 1s are one run at the end `padding_side` does not pad."""
    mask = jnp.asarray(attention_mask) if _is_concrete(attention_mask) else attention_mask
    if mask.ndim == 1:
        mask = mask[None]
    if mask.shape != (b, p):
        raise JspecError(f"attention_mask must have the prompt_ids shape ({b}, {p}), got "
                         f"{mask.shape}")
    if not (jnp.issubdtype(mask.dtype, jnp.integer) or mask.dtype == jnp.bool_):
        raise JspecError(f"attention_mask must be integers or booleans, got {mask.dtype}")
    lengths = jnp.sum(mask != 0, axis=-1).astype(jnp.int32)
    if _is_concrete(mask):
        m = np.asarray(mask).astype(np.int64)
        if ((m != 0) & (m != 1)).any():
            raise JspecError("attention_mask must hold only 0s and 1s")
        ln = m.sum(axis=-1)
        cols = np.arange(p)[None, :]
        right = (cols < ln[:, None]).astype(np.int64)
        left = (cols >= p - ln[:, None]).astype(np.int64)
        want, mirror = (right, left) if padding_side == "right" else (left, right)
        other, where = ("left", "start") if padding_side == "right" else ("right", "end")
        for r in np.flatnonzero((m != want).any(axis=-1)):
            hint = (f"; it looks {other}-padded: pass padding_side={other!r}"
                    if (m[r] == mirror[r]).all() else "")
            raise JspecError(f"attention_mask row {r} is not one run of 1s at the {where} of "
                             f"the row, as padding_side={padding_side!r} needs{hint}")
    return lengths


def _pad_runs(arr: np.ndarray, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(leading, trailing) i64[B]: lengths of the runs of `pad_id` at each end of i32[B, P]."""
    is_pad = arr == pad_id
    lead = np.cumprod(is_pad, axis=1).sum(axis=1)
    trail = np.cumprod(is_pad[:, ::-1], axis=1).sum(axis=1)
    return lead, trail


def _check_unmarked_padding(arr: np.ndarray, pad_id: int) -> None:
    """Without lengths or a mask every position is prompt: rows of a batch that end (or start)
    in different numbers of pad tokens are almost surely a padded batch whose padding would be
    read as prompt."""
    if arr.shape[0] < 2:
        return
    lead, trail = _pad_runs(arr, pad_id)
    for name, run in (("end", trail), ("start", lead)):
        if (run != run[0]).any():
            raise JspecError(
                f"rows {name} in different numbers of pad tokens (id {pad_id}): "
                f"{run.tolist()}; without prompt_lengths every position is read as prompt. "
                "Pass prompt_lengths= or attention_mask= for a padded batch (and "
                "padding_side='left' if it is left-padded)")


def _check_padding_side(arr: np.ndarray, lengths: np.ndarray, pad_id: int,
                        padding_side: str, *, pad_is_bos: bool = False) -> None:
    """A short row whose declared-real end holds at least its padding's worth of pad tokens
    while its declared-padding end does not is padded on the other side. When the pad token is
    also BOS, a right-padded prompt's own first token is one: the start needs one more."""
    p = arr.shape[1]
    lead, trail = _pad_runs(arr, pad_id)
    n_pad = p - lengths
    real_end, pad_end = (lead, trail) if padding_side == "right" else (trail, lead)
    need = n_pad + int(pad_is_bos and padding_side == "right")
    wrong = (n_pad > 0) & (real_end >= need) & (pad_end < n_pad)
    if wrong.any():
        r = int(np.flatnonzero(wrong)[0])
        other, end = ("left", "starts") if padding_side == "right" else ("right", "ends")
        raise JspecError(
            f"row {r} ({int(lengths[r])} of {p} tokens, padding_side={padding_side!r}) {end} "
            f"with {int(n_pad[r])} pad tokens (id {pad_id}) where its prompt should be: it looks "
            f"{other}-padded; pass padding_side={other!r} (if the prompt really {end} with pad "
            "tokens, fill its padding with pad tokens too)")


def left_to_right_padded(ids: jax.Array, lengths: jax.Array) -> jax.Array:
    """i32[B, P] left-padded rows (the last `lengths` i32[B] entries real) as right-padded
    rows, zeros after each length. A per-row gather: works under jit on traced ids and lengths."""
    p = ids.shape[1]
    cols = jnp.arange(p, dtype=jnp.int32)[None, :]
    src = (cols + (p - lengths)[:, None]) % p  # each row rolled left by its padding
    return jnp.where(cols < lengths[:, None], jnp.take_along_axis(ids, src, axis=1), 0)


def pad_to_bucket(ids: jax.Array) -> jax.Array:
    """Right-pad i32[B, P] with zeros to the length bucket (a no-op under a trace)."""
    p = ids.shape[1]
    width = bucket_length(p)
    if width == p:
        return ids
    return jnp.pad(ids, ((0, 0), (0, width - p)))


def generate(model: Model, prompt_ids: Any, prompt_lengths: Any = None, *,
             attention_mask: Any = None, padding_side: str = "right", drafter: Any = None,
             max_new_tokens: int = 128, sampling: Sampling = Sampling(), verifier: Any = None,
             length: Any = None, key: jax.Array | None = None, capacity: int | None = None,
             attention_impl: str | None = None, mesh: Mesh | None = None
             ) -> GenerateOutput:
    """Generate up to `max_new_tokens` tokens per prompt; works inside a user's `jax.jit`.

    Args:
      model: the target model.
      prompt_ids: i32[B, P] prompt token ids padded on `padding_side` (or i32[P] for one
        prompt).
      prompt_lengths: i32[B] real lengths (default: all P; concrete ids of a batch whose rows
        end or start in different numbers of `model.pad_id` tokens are then refused).
      attention_mask: i32|bool[B, P], Hugging Face style (1 on real tokens): an alternative to
        `prompt_lengths` (lengths are its row sums; when concrete, it must be one run of 1s on
        the side `padding_side` does not pad).
      padding_side: "right" (default: real tokens first) or "left" (Hugging Face batches: real
        tokens last; rows are moved to the right-padded layout with a per-row gather, also
        under jit).
      drafter: None for plain autoregressive decoding.
      max_new_tokens: static maximum of new tokens per row.
      sampling: `Sampling(temperature, top_k, top_p)`; temperature 0 is greedy.
      key: PRNG key for sampling (default `jax.random.key(0)`).
      capacity: static KV-cache slots (default: prompt bucket + max_new_tokens, rounded up).
      attention_impl: "auto" | "xla" | "pallas": overrides `model.config.attention_impl` for the
        target's forward passes (a drafter keeps its own config).
      mesh: static; run sharded on this `jax.sharding.Mesh` (axes "data" and "model", see
        `jspec.sharding`); default: the mesh set with `jax.set_mesh`, if any, else one device.
        Weights, drafter, prompts and the decode state are laid out by `jspec.sharding.RULES`.
    Returns:
      GenerateOutput: tokens i32[B, max_new_tokens] (-1 after each row's end), lengths i32[B],
      stats. Under a mesh, arrays are sharded over `data` by row.
    """
    if not isinstance(sampling, Sampling):
        raise JspecError(f"sampling must be a jspec.Sampling, got {type(sampling).__name__}")
    if attention_impl is not None:
        model = model.with_attention_impl(attention_impl)
    ids, lengths = validate_prompts(model, prompt_ids, prompt_lengths, max_new_tokens, capacity,
                                    attention_mask=attention_mask, padding_side=padding_side)
    ids = pad_to_bucket(ids)
    key = jax.random.key(0) if key is None else key
    statics = _statics(model, ids, drafter, sampling, max_new_tokens, verifier, length, capacity,
                       mesh)
    verifier = statics.pop("verifier")
    with sharding.using(statics["mesh"]):
        weights, drafter, verifier, ids, lengths, key = _place_inputs(
            statics["mesh"], model, drafter, verifier, ids, lengths, key)
        return _generate(weights, drafter, verifier, ids, lengths, key, **statics)


def _place_inputs(mesh: Mesh | None, model: Model, drafter: Any, verifier: Any, ids: jax.Array,
                  lengths: jax.Array, key: jax.Array) -> tuple[Any, ...]:
    """Transfer the inputs to their mesh layout once, before the jitted call (a no-op for
    arrays already placed, e.g. with `jspec.sharding.shard_model`)."""
    if mesh is None:
        return model.weights, drafter, verifier, ids, lengths, key
    weights = sharding.shard_model(model, mesh).weights
    drafter = sharding.shard_drafter(drafter, mesh)
    verifier = sharding.place(verifier, sharding.replicated(verifier, mesh))
    ids, lengths, key = sharding.place((ids, lengths, key), sharding.state_sharding(
        (ids, lengths, key), mesh, batch=ids.shape[0]))
    return weights, drafter, verifier, ids, lengths, key


def _statics(model: Model, ids: jax.Array, drafter: Any, sampling: Sampling, max_new_tokens: int,
             verifier: Any, length: Any, capacity: int | None, mesh: Mesh | None = None
             ) -> dict[str, Any]:
    from jspec.length import FixedLength, LibraSpec  # noqa: PLC0415
    from jspec.verify import ASD, Diversed, Lossless  # noqa: PLC0415

    k = 0
    if drafter is not None:
        length = FixedLength() if length is None else length
        verifier = Lossless() if verifier is None else verifier
        if not isinstance(length, (FixedLength, LibraSpec)):
            raise JspecError("length must be a jspec.FixedLength or jspec.LibraSpec, got "
                             f"{type(length).__name__}")
        if isinstance(length, LibraSpec):
            _check_libraspec(length, drafter, verifier)
        if not isinstance(verifier, (Lossless, ASD, Diversed)):
            raise JspecError(f"unsupported verifier {type(verifier).__name__} "
                             "(jspec.Lossless, jspec.ASD or jspec.Diversed)")
        verifier.check(sampling)
        if isinstance(verifier, Diversed) and verifier.head is not None:
            verifier.head.check(model.config, getattr(drafter, "hidden_size", None))
        k = length.max_k
    elif verifier is not None or length is not None:
        raise JspecError("verifier= and length= need a drafter")
    # Slots a round writes beyond `last`: k, or a tree drafter's T - 1 nodes.
    look = drafter.lookahead(k) if hasattr(drafter, "lookahead") else k
    cap = capacity or cache_capacity(ids.shape[1], max_new_tokens, look)
    if cap < ids.shape[1] + max_new_tokens + look + 1:
        raise JspecError(f"prompt width {ids.shape[1]} + max_new_tokens {max_new_tokens} + a "
                         f"verify block of {look + 1} does not fit the cache capacity {cap}")
    return dict(config=model.config, sampling=sampling, max_new_tokens=max_new_tokens,
                capacity=cap, eos_ids=model.eos_ids, k=k, verifier=verifier,
                length=length if isinstance(length, LibraSpec) else None,
                mesh=sharding.resolve_mesh(mesh))


def _check_libraspec(policy: Any, drafter: Any, verifier: Any) -> None:
    from jspec.verify import Lossless  # noqa: PLC0415

    if not (hasattr(drafter, "extend") and hasattr(drafter, "block_tokens")):
        raise JspecError(f"LibraSpec needs a block drafter with confidences that can draft more "
                         f"blocks (DFlash); {getattr(drafter, 'name', type(drafter).__name__)!r} "
                         "cannot")
    if not isinstance(verifier, Lossless):
        raise JspecError("LibraSpec verifies losslessly: use verifier=jspec.Lossless() "
                         f"(got {type(verifier).__name__})")


def stream(model: Model, prompt_ids: Any, prompt_lengths: Any = None, *,
           attention_mask: Any = None, padding_side: str = "right", drafter: Any = None,
           max_new_tokens: int = 128, sampling: Sampling = Sampling(), verifier: Any = None,
           length: Any = None, key: jax.Array | None = None, rounds_per_dispatch: int = 8,
           attention_impl: str | None = None, mesh: Mesh | None = None):
    """Yield (tokens i32[B, N], num_new i32[B], stats, all_done) after each dispatch.

    The same rounds as `generate`, `rounds_per_dispatch` of them per device dispatch; the host
    reads the state once per dispatch (not per token), which lets a terminal show text as it
    is produced. `attention_mask`, `padding_side`, `attention_impl` and `mesh` as in
    `generate`.
    """
    if attention_impl is not None:
        model = model.with_attention_impl(attention_impl)
    ids, lengths = validate_prompts(model, prompt_ids, prompt_lengths, max_new_tokens, capacity=None,
                                    attention_mask=attention_mask, padding_side=padding_side)
    ids = pad_to_bucket(ids)
    key = jax.random.key(0) if key is None else key
    statics = _statics(model, ids, drafter, sampling, max_new_tokens, verifier, length, None,
                       mesh)
    verifier = statics.pop("verifier")
    mesh = statics["mesh"]
    with sharding.using(mesh):
        weights, drafter, verifier, ids, lengths, key = _place_inputs(
            mesh, model, drafter, verifier, ids, lengths, key)
        state = _init_jit(weights, drafter, verifier, ids, lengths, key, **statics)
    loop_statics = {k: statics[k] for k in ("config", "sampling", "eos_ids", "k", "length",
                                            "mesh")}
    while True:
        tokens, num_new, done, st = jax.device_get(
            (state.tokens, state.num_new, state.done, state.stats))
        yield tokens, num_new, st, bool(done.all())
        if done.all():
            return
        with sharding.using(mesh):
            state = _chunk_jit(weights, drafter, verifier, state, rounds=rounds_per_dispatch,
                               **loop_statics)
