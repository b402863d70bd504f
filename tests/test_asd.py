"""ASD (ALGORITHMS §2): budgeted approximate greedy verification."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

import jspec
from jspec.drafters import DraftModel, NGram

GREEDY = jspec.Sampling()


def _logits(rows):
    """f32[1, K+1, V] logits from per-position lists."""
    return jnp.asarray([rows], jnp.float32)


def _verify(asd, draft, logits, budget=None):
    state = asd.init_state(1, 4)
    if budget is not None:
        state.budget = jnp.asarray([budget], jnp.float32)
    k = len(draft)
    return asd.verify(state, None, jnp.asarray([draft], jnp.int32), None, _logits(logits), GREEDY,
                      jnp.ones((1, k), bool))


def test_gate_cap_budget_and_suffix_reuse():
    # K=3, V=3. Target argmax per position: 0, 1, 2, 0 (last = bonus position).
    logits = [[5.0, 4.5, 0.0], [0.0, 5.0, 1.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]]
    # Draft [1, 1, 2]: mismatch at i=0 with regret 0.5 (value K-0 = 3, ratio 0.167), then
    # exact matches: the whole block plus the bonus argmax is committed.
    n, nxt, st = _verify(jspec.ASD(budget=8, gate=0.25, cap=2), [1, 1, 2], logits)
    assert int(n[0]) == 3 and int(nxt[0]) == 0
    np.testing.assert_allclose(st.budget, [7.5])
    # A stricter gate (0.1 < 0.167) rejects it: strict-greedy behaviour.
    n, nxt, st = _verify(jspec.ASD(budget=8, gate=0.1, cap=2), [1, 1, 2], logits)
    assert int(n[0]) == 0 and int(nxt[0]) == 0 and float(st.budget[0]) == 8.0
    # Budget smaller than the regret: rejected.
    n, _, _ = _verify(jspec.ASD(budget=8, gate=0.25, cap=2), [1, 1, 2], logits, budget=0.4)
    assert int(n[0]) == 0
    # Two mismatches: i=0 (regret 0.5, ratio 0.5/3) and i=2 (regret 0.1, ratio 0.1/1).
    logits2 = [[5.0, 4.5, 0.0], [0.0, 5.0, 1.0], [0.0, 4.9, 5.0], [5.0, 0.0, 0.0]]
    n, nxt, st = _verify(jspec.ASD(budget=8, gate=0.25, cap=2), [1, 1, 1], logits2)
    assert int(n[0]) == 3 and int(nxt[0]) == 0
    np.testing.assert_allclose(st.budget, [7.4], rtol=1e-6)
    # The per-block cap of 1 stops at the second mismatch; the target's token replaces it.
    n, nxt, st = _verify(jspec.ASD(budget=8, gate=0.25, cap=1), [1, 1, 1], logits2)
    assert int(n[0]) == 2 and int(nxt[0]) == 2
    np.testing.assert_allclose(st.budget, [7.5], rtol=1e-6)


@pytest.mark.parametrize("asd", [jspec.ASD(budget=0), jspec.ASD(gate=0), jspec.ASD(cap=0)])
@pytest.mark.parametrize("k", [2, pytest.param(5, marks=pytest.mark.slow)])
def test_zero_settings_reproduce_strict_greedy(asd, k):
    model = tiny_model("llama_tied_gqa2", seed=1)
    other = tiny_model("llama_tied_gqa2", seed=7)
    ids = np.asarray([[5, 6, 7, 5, 6], [9, 10, 11, 0, 0]], np.int32)
    lengths = np.asarray([5, 3], np.int32)
    ar = jspec.generate(model, ids, lengths, max_new_tokens=20)
    for drafter in (NGram(), DraftModel(weights=other.weights, config=other.config)):
        out = jspec.generate(model, ids, lengths, max_new_tokens=20, drafter=drafter,
                             length=jspec.FixedLength(k), verifier=asd)
        np.testing.assert_array_equal(out.tokens, ar.tokens)


def test_loose_asd_accepts_more_and_spends_its_budget():
    model = tiny_model("llama_tied_gqa2", seed=1)
    other = tiny_model("llama_tied_gqa2", seed=7)
    drafter = DraftModel(weights=other.weights, config=other.config)
    ids = np.tile(np.asarray([[5, 6, 7]], np.int32), (8, 1)) + np.arange(8)[:, None]
    kw = dict(max_new_tokens=24, drafter=drafter, length=jspec.FixedLength(4))
    strict = jspec.generate(model, ids, **kw)
    loose = jspec.generate(model, ids, verifier=jspec.ASD(budget=1000, gate=10.0, cap=4), **kw)
    assert loose.stats.accepted.sum() > strict.stats.accepted.sum()
    assert (np.asarray(loose.verifier.budget) <= 1000).all()
    assert (np.asarray(loose.verifier.budget) < 1000).any()
    small = jspec.generate(model, ids, verifier=jspec.ASD(budget=0.5, gate=10.0, cap=4), **kw)
    assert (np.asarray(small.verifier.budget) >= -1e-6).all()  # never overspent


def test_asd_rejects_sampling_and_bad_settings():
    model = tiny_model()
    with pytest.raises(jspec.JspecError, match="greedy"):
        jspec.generate(model, np.asarray([[5, 6]], np.int32), drafter=NGram(),
                       sampling=jspec.Sampling(temperature=1.0), verifier=jspec.ASD())
    for bad in (dict(budget=-1), dict(gate=-0.1), dict(cap=-1), dict(cap=1.5)):
        with pytest.raises(jspec.JspecError):
            jspec.ASD(**bad)


def test_record_mode_collects_first_rejection_ratios():
    model = tiny_model("llama_tied_gqa2", seed=1)
    other = tiny_model("llama_tied_gqa2", seed=7)
    drafter = DraftModel(weights=other.weights, config=other.config)
    out = jspec.generate(model, np.asarray([[5, 6, 7]], np.int32), max_new_tokens=24,
                         drafter=drafter, length=jspec.FixedLength(4),
                         verifier=jspec.ASD(budget=0, record=True))
    n = int(out.verifier.n_ratios[0])
    r = np.asarray(out.verifier.ratios[0])
    assert 0 < n <= int(out.stats.rounds[0])
    assert (r[:n] > 0).all() and np.isnan(r[n:]).all()
