"""Losslessness of trees drawn from q at low temperature (default run), beside the T = 1 runs
of tests/test_distribution.py.

The tiny models there are flat on purpose; at T = 0.1 the random tiny EAGLE-3's q and the
target's p barely meet (τ = 1.000: no drafted token accepted, so a χ² cannot see a
verification bug). Here the target is a Markov chain (`markov_target`: a one-layer model whose
next-token distribution depends on the current token only; its logits are T·log P, so its
distribution at temperature T is the table P) and the drafter an expanding Markov chain
(`MarkovTreeDrafter`: jspec's `expand_tree` draws each expanded node's children from q without
replacement), sharpened: after token a its mode is the target's mode, every other token 0.5 to
140 nats below it, so the mass left after the first child falls in every float32 regime
(normal, 1.2e-38 .. 1e-30, flushed to 0). Rounds, `Lossless.verify_tree` and sampling are
jspec's own. The exact law of one round is checked by enumeration in tests/test_exact_law.py;
this is the end-to-end check through `generate`'s rounds.

Statistic (tests/stats.py): ROWS = 4096 independent rows of one prompt per side; per new-token
position t = 1..4 a two-sample χ² of speculative against autoregressive rows (rare tokens
pooled), Holm over the positions at α = 0.01; the A/A control (autoregressive against
autoregressive, another key) through the same statistic; a goodness-of-fit test of the
speculative rows against the exact marginals e_a·P^(t+1), Holm at α = 0.01. Seeds:
autoregressive key 1, A/A key 2, speculative key 3; tables numpy default_rng(7).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from stats import compare_positions, fit_positions, generate_rows
from test_libraspec import markov_target

import jspec
from jspec.drafters.base import Capabilities, ChainDrafter
from jspec.drafters.topk_tree import TopKTree, expand_tree
from jspec.sampling import categorical, process_logits
from jspec.verify import Lossless

ROWS, ALPHA, K, T = 4096, 0.01, 3, 0.1
V = 8
PROMPT = [3, 4, 5, 3, 4, 5, 3, 4]
AR_SEED, AA_SEED, SPEC_SEED = 1, 2, 3
REGIMES = ((0.5, 60.0), (69.5, 86.5), (88.5, 140.0))  # nats below the mode; see module doc


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MarkovTreeDrafter(ChainDrafter):
    """An expanding drafter whose q after token a is softmax(process_logits(logits[a])):
    chains drawn token by token, trees by `expand_tree` (children drawn from q without
    replacement at T > 0, the most probable ones when greedy)."""

    logits: jax.Array  # f32[V, V]
    name = "markov-tree"

    @property
    def caps(self) -> Capabilities:
        return Capabilities(expands=True)

    def init_state(self, features, prompt_ids, prompt_lengths, capacity, *, k, verify_width=None):
        return None

    def _logp(self, tok, sampling):
        z = self.logits[tok]
        return jax.nn.log_softmax(z if sampling.greedy else process_logits(z, sampling), -1)

    def propose(self, state, ctx, k, sampling, key):
        toks, qs, last = [], [], ctx.last
        for kk in jax.random.split(key, k):
            logp = self._logp(last, sampling)
            last = (jnp.argmax(logp, -1) if sampling.greedy else categorical(kk, logp)
                    ).astype(jnp.int32)
            toks.append(last)
            qs.append(jnp.exp(logp))
        return jnp.stack(toks, 1), None if sampling.greedy else jnp.stack(qs, 1), state

    def draft_tree(self, state, ctx, *, depth, k, width, n, sampling=None, key=None):
        drawn = key is not None and sampling is not None and not sampling.greedy
        s = sampling if drawn else jspec.Sampling()
        tokens, parents, q, _ = expand_tree(
            self._logp(ctx.last, s), None, lambda c, lvl, tok, par, anc: (self._logp(tok, s), c),
            None, depth=depth, k=k, width=width, n=n, key=key if drawn else None)
        return tokens, parents, q, state


@functools.cache
def _case() -> tuple[jspec.Model, np.ndarray, MarkovTreeDrafter]:
    """(target model, its P at T f64[V, V], the sharpened drafter)."""
    rng = np.random.default_rng(7)
    p = rng.dirichlet(np.ones(V), size=V)
    model, _ = markov_target(np.exp(T * np.log(p)))  # logits T·log P (up to a constant)
    gaps = np.empty((V, V))
    for a in range(V):
        gaps[a] = [rng.uniform(*REGIMES[rng.integers(3)]) for _ in range(V)]
        gaps[a, np.argmax(p[a])] = 0.0
    model = jspec.Model(config=model.config, weights=model.weights, name="markov-low-t")
    return model, p, MarkovTreeDrafter(jnp.asarray(-T * gaps, jnp.float32))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class QBeforeTemperature(Lossless):
    """Broken: verifies a drawn tree with the drafter's q before temperature (q^T
    renormalised: the T = 1 distribution), not the q its children were drawn from."""

    def verify_tree(self, vstate, key, tokens, parents, depth, valid, target_logits, sampling,
                    max_depth, q=None, q_vocab=None, max_children=0):
        if q is not None:
            q = q ** sampling.temperature
            q = q / jnp.sum(q, -1, keepdims=True).clip(1e-30)
        return super().verify_tree(vstate, key, tokens, parents, depth, valid, target_logits,
                                   sampling, max_depth, q=q, q_vocab=q_vocab,
                                   max_children=max_children)


_AR: dict = {}


def _rows(seed: int, **kw):
    model = _case()[0]
    return generate_rows(model, PROMPT, ROWS, batch=ROWS, seed=seed, max_new_tokens=K + 2,
                         sampling=jspec.Sampling(temperature=T), **kw)


@pytest.mark.parametrize("broken,lookup", [(False, False), (False, True), (True, False)],
                         ids=["T0.1", "T0.1-lookup-look6", "broken-q-before-temperature"])
def test_drawn_tree_at_low_temperature(broken, lookup):
    """A tree drawn from the sharpened Markov drafter (`+topk` k = 3, 8 nodes, depth K = 3)
    at T = 0.1 is lossless: speculative rows against autoregressive ones and against the exact
    marginals (ROWS = 4096 per side, Holm α = 0.01 over t = 1..4, keys 1 / 2 / 3, A/A control
    passing); τ > 1.2 (≈ 1.56: drafts are accepted). `lookup`: inside the n-gram lookup
    (`+ngram:n_min=1,look=6`), rows that find a match propose a looked-up chain with empty q
    rows (deterministic slots, verified one-hot in the same procedure; τ ≈ 1.42). Broken
    variant: the tree verified with q before temperature is rejected by the same statistic
    (two-sample p ≈ 1e-41, fit p ≈ 1e-70) while its A/A control passes. Against the 1e-30
    clamp verify_tree_drawn had (issue 56) both lossless cases fail (T0.1: two-sample p =
    4e-79, fit p = 5e-291)."""
    from jspec.drafters.ngram import LookupFirst

    _, p, drafter = _case()
    tree = TopKTree(inner=drafter, k=3, nodes=8, draw=True)
    if lookup:
        tree = LookupFirst(inner=tree, n_min=1, look=6)
    if "ar" not in _AR:
        _AR["ar"] = _rows(AR_SEED).tokens
        _AR["aa"] = compare_positions(_AR["ar"], _rows(AA_SEED).tokens, range(1, K + 2), ALPHA)
    ar, aa = _AR["ar"], _AR["aa"]
    sp = _rows(SPEC_SEED, drafter=tree, length=jspec.FixedLength(K),
               verifier=QBeforeTemperature() if broken else Lossless())
    test = compare_positions(ar, sp.tokens, range(1, K + 2), ALPHA)
    dist, exact = np.eye(V)[PROMPT[-1]], {}
    for t in range(K + 2):
        dist = dist @ p
        exact[t] = dist
    fit = fit_positions(sp.tokens, {t: exact[t] for t in range(1, K + 2)}, ALPHA)
    assert aa.same, f"A/A control: {aa}"
    if broken:
        assert not (test.same and fit.same), (test, fit)
        return
    assert test.same, f"speculative vs autoregressive: {test}"
    assert fit.same, f"speculative vs exact marginals: {fit}"
    assert sp.tau > 1.2, sp.tau
    assert test.dof >= 3 * (K + 1), test
