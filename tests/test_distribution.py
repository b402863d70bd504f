"""Losslessness by distribution on tiny models (default run): top-k and top-p, an EAGLE-3
drafter's real q at T > 0, tree rounds and the n-gram lookup wrapper at T > 0, and broken
variants the same statistic rejects.

Every check (tests/stats.py): ROWS independent rows of one prompt; the marginal of new token t
over the rows, for t = 1..K+1 (every slot of the first round, the bonus included), compared
between speculative and autoregressive rows by a two-sample χ² per position (rare tokens pooled
at expected count < 5), Holm's correction over the positions at overall α = 0.01; an A/A control
(autoregressive against autoregressive, another key) through the same statistic; and at t = 1
and 2 a goodness-of-fit test of the speculative rows against the exact marginals (enumerated:
vocabulary 97, so 97² prefixes), Holm at α = 0.01. Seeds: autoregressive key 1, the A/A
control key 2, speculative key 3 (`generate_rows`: key fold_in(key(seed), call)).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from stats import (
    chi2_goodness_of_fit,
    chi2_two_sample,
    compare_positions,
    exact_marginals,
    fit_positions,
    generate_rows,
    holm,
)
from test_d2sd import GuessTree, tiny_d2sd
from test_trained_drafters import tiny_cfg

import jspec
from jspec.drafters import eagle3
from jspec.drafters.base import ChainDrafter
from jspec.drafters.ngram import LookupFirst
from jspec.sampling import dense_q, process_logits, sample_from_probs
from jspec.verify import Lossless, verify_chain

ROWS, ALPHA, K = 4096, 0.01, 3
PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]
AR_SEED, AA_SEED, SPEC_SEED = 1, 2, 3


@functools.cache
def flat_model() -> jspec.Model:
    """The tiny Llama with a flatter output distribution (embedding × 0.3: many tokens carry
    mass, so a χ² has many categories) and no EOS (every row runs to the end)."""
    base = tiny_model("llama_tied_gqa2", seed=5)
    return jspec.Model(config=base.config.replace(eos_ids=()),
                       weights=dataclasses.replace(base.weights, embed=base.weights.embed * 0.3),
                       name="flat")


@functools.cache
def tiny_eagle3(include: tuple[int, ...] = (), exclude: tuple[int, ...] = ()
                ) -> tuple[jspec.Model, eagle3.Eagle3]:
    """A random EAGLE-3 drafter (draft vocabulary: 64 of the 97 tokens, `include` among them,
    `exclude` not)
    on `flat_model`, its final norm scaled down so that q is broad and overlaps p (τ ≈ 1.27 at
    K = 3, T = 1)."""
    model = flat_model()
    cfg = tiny_cfg("eagle3", model)
    params = eagle3.init_params(cfg, jax.random.key(3))
    params = dataclasses.replace(params, final_norm=params.final_norm * 0.3)
    perm = np.random.default_rng(0).permutation(model.config.vocab_size)
    perm = np.asarray([*include, *(t for t in perm if t not in include + exclude)], perm.dtype)
    vocab = np.sort(perm[:64])
    return model, eagle3.make(cfg, params, vocab, model.weights)


_AR: dict = {}


def _autoregressive(model: jspec.Model, sampling: jspec.Sampling, seed: int) -> np.ndarray:
    key = (model.name, sampling, seed)
    if key not in _AR:
        _AR[key] = generate_rows(model, PROMPT, ROWS, batch=ROWS, seed=seed,
                                 max_new_tokens=K + 2, sampling=sampling).tokens
    return _AR[key]


@functools.cache
def _exact(model_name: str, sampling: jspec.Sampling) -> dict[int, np.ndarray]:
    model = {"flat": flat_model, "d2sd-target": lambda: _d2sd()[0]}[model_name]()
    m = exact_marginals(model, PROMPT, sampling, upto=2)
    return {t: m[t] for t in (1, 2)}


def check_lossless(model: jspec.Model, sampling: jspec.Sampling, **kw) -> tuple:
    """(A/A test, speculative-vs-autoregressive test, exact-fit test, speculative Rows)."""
    ar = _autoregressive(model, sampling, AR_SEED)
    aa = compare_positions(ar, _autoregressive(model, sampling, AA_SEED), range(1, K + 2), ALPHA)
    sp = generate_rows(model, PROMPT, ROWS, batch=ROWS, seed=SPEC_SEED, max_new_tokens=K + 2,
                       sampling=sampling, **kw)
    test = compare_positions(ar, sp.tokens, range(1, K + 2), ALPHA)
    fit = fit_positions(sp.tokens, _exact(model.name, sampling), ALPHA)
    return aa, test, fit, sp


def _assert_lossless(aa, test, fit, sp, min_tau: float) -> None:
    assert aa.same, f"A/A control: {aa}"
    assert test.same, f"speculative vs autoregressive: {test}"
    assert fit.same, f"speculative vs exact marginals: {fit}"
    # Meaningful only when drafts are accepted and the distributions are spread out.
    assert sp.tau > min_tau, sp.tau
    assert test.dof >= 4 * (K + 1), test


# ---------------------------------------------------------------------------- the statistic
def test_chi2_helpers_on_known_tables():
    """The helpers against scipy on a hand-made table, pooling of rare categories, Holm."""
    from scipy import stats as sps

    a = np.repeat([0, 1, 2, 3], [50, 30, 15, 5])
    b = np.repeat([0, 1, 2, 3, 9], [40, 35, 20, 4, 1])
    got = chi2_two_sample(a, b)
    # 3 and 9 are rare (expected < 5): pooled into one "other" column of 10.
    table = np.asarray([[50, 30, 15, 5], [40, 35, 20, 5]])
    want = sps.chi2_contingency(table, correction=False)
    assert got.dof == 3 and got.categories == 4
    np.testing.assert_allclose([got.stat, got.pvalue], [want[0], want[1]], rtol=1e-9)
    assert chi2_two_sample(np.zeros(10), np.zeros(12)).pvalue == 1.0
    assert chi2_two_sample(np.zeros(500), np.ones(500)).pvalue < 1e-100
    p = np.asarray([0.25, 0.25, 0.5])
    obs = np.repeat([0, 1, 2], [30, 20, 50])
    fit = chi2_goodness_of_fit(obs, p)
    np.testing.assert_allclose(fit.pvalue, sps.chisquare([30, 20, 50], [25, 25, 50])[1])
    assert chi2_goodness_of_fit(np.asarray([0, 1, 2]), np.asarray([0.5, 0.5, 0.0])).pvalue == 0
    # m = 4: 0.001 <= 0.01/4 and 0.003 <= 0.01/3 are rejected, then 0.02 > 0.01/2 stops.
    np.testing.assert_array_equal(holm([0.001, 0.02, 0.003, 0.5], 0.01),
                                  [True, False, True, False])
    np.testing.assert_array_equal(holm([0.001, 0.02, 0.004, 0.5], 0.01),
                                  [True, False, False, False])
    np.testing.assert_array_equal(holm([0.003, 0.004], 0.01), [True, True])
    np.testing.assert_array_equal(holm([0.012, 0.004], 0.01), [False, True])


def test_exact_marginals_match_plain_sampling():
    """`exact_marginals` against ROWS autoregressive rows (key 1) at t = 0, 1, 2 (Holm α=0.01):
    the reference the other tests fit to is itself right."""
    model, s = flat_model(), jspec.Sampling(temperature=1.0)
    m = exact_marginals(model, PROMPT, s, upto=2)
    for t in (0, 1, 2):
        np.testing.assert_allclose(m[t].sum(), 1.0, atol=1e-5)
    fit = fit_positions(_autoregressive(model, s, AR_SEED), m, ALPHA)
    assert fit.same, fit
    assert fit.dof >= 30, fit


# ------------------------------------------------------------------------ lossless settings
_TOPK = jspec.Sampling(temperature=1.0, top_k=10)
_TOPP = jspec.Sampling(temperature=0.8, top_p=0.8)
_T1 = jspec.Sampling(temperature=1.0)


@pytest.mark.parametrize("sampling", [_TOPK, _TOPP], ids=["T1-top_k10", "T0.8-top_p0.8"])
def test_top_k_top_p_with_real_q(sampling):
    """Top-k / top-p filtering applied to p and to the drafter's q alike: early-exit:1 (the
    target's first layer, a real q) at K = 3 on `flat_model`. ROWS = 4096 per side, α = 0.01
    (Holm over t = 1..4), keys 1 / 2 / 3; τ > 1.3."""
    model = flat_model()
    drafter = jspec.load_drafter("early-exit:1", target=model)
    _assert_lossless(*check_lossless(model, sampling, drafter=drafter,
                                     length=jspec.FixedLength(K)), min_tau=1.3)


@pytest.mark.parametrize("sampling, min_tau, q_temperature", [
    (_T1, 1.2, 1.0),
    pytest.param(jspec.Sampling(temperature=1.0, top_k=40), 1.1, 1.0, marks=pytest.mark.slow),
    (_T1, 1.1, 0.5)], ids=["T1", "T1-top_k40", "T1-qtemp0.5"])
def test_eagle3_real_q(sampling, min_tau, q_temperature):
    """A trained-drafter code path (EAGLE-3: draft vocabulary, full-vocabulary q after the same
    filtering) verified with its real q at K = 3. ROWS = 4096 per side, α = 0.01 (Holm over
    t = 1..4), keys 1 / 2 / 3; τ > 1.2 at T = 1 (≈ 1.27), > 1.1 with top-k 40 (≈ 1.15; a
    top-k of 10 leaves the random drafter's q almost disjoint from p), > 1.1 with the drafter's
    q sharpened (`q_temperature` 0.5: q = softmax(z / 0.5), no longer the drafter's own
    distribution, still lossless)."""
    model, drafter = tiny_eagle3()
    if q_temperature != 1.0:
        drafter = dataclasses.replace(drafter, cfg=dataclasses.replace(
            drafter.cfg, q_temperature=q_temperature))
    _assert_lossless(*check_lossless(model, sampling, drafter=drafter,
                                     length=jspec.FixedLength(K)), min_tau=min_tau)


@functools.cache
def _d2sd():
    base, drafter = tiny_d2sd("llama_tied_gqa2", 2)
    return jspec.Model(config=base.config.replace(eos_ids=()), weights=base.weights,
                       name="d2sd-target"), drafter


@pytest.mark.parametrize("kind", ["d2sd", "guess"])
def test_tree_round_at_t1(kind):
    """Tree rounds at T = 1, K = 3: the tiny D²SD drafter (chain + 3 branches of 2 nodes; it
    drafts greedily, the walk samples the target) and `GuessTree` (every node drawn at random
    from the 6 likeliest tokens with the round's draft key, 3 branches of 2). The tiny D²SD
    target (no EOS). ROWS = 4096 per side, α = 0.01 (Holm over t = 1..4), keys 1 / 2 / 3;
    τ > 1.3 (D²SD) / 1.1 (guesses)."""
    model, drafter = _d2sd()
    if kind == "guess":
        ar = _autoregressive(model, _T1, AR_SEED)
        vals, counts = np.unique(ar, return_counts=True)
        drafter = GuessTree(guesses=jnp.asarray(vals[np.argsort(-counts)[:6]], jnp.int32),
                            branch_len=2)
    aa, test, fit, sp = check_lossless(model, _T1, drafter=drafter, length=jspec.FixedLength(K))
    assert aa.same and test.same and fit.same, (aa, test, fit)
    assert sp.tau > (1.3 if kind == "d2sd" else 1.1), sp.tau
    assert test.dof >= 2 * (K + 1), test


@pytest.mark.parametrize("inner", ["early-exit:1", "eagle3"])
def test_topk_tree_at_t1(inner):
    """The top-k tree around a chain drafter at T = 1 (k = 3 children, 8 nodes, chain length
    K = 3) on `flat_model`: early-exit:1 and the tiny EAGLE-3 (a trained drafter's features
    along a path that may leave the chain), the k most probable children walked (`draw=False`;
    drawn trees: `test_drawn_topk_tree_at_t1`). ROWS = 4096 per side, α = 0.01 (Holm over
    t = 1..4), keys 1 / 2 / 3; τ > 1.1 for early-exit (≈ 1.15: the walk accepts a node with
    the target's probability of its token, below the chain's min(1, p/q) with the real q) and
    > 1.005 for the random EAGLE-3 (≈ 1.01: ~270 accepted drafts in 16,384 tokens)."""
    from jspec.drafters.topk_tree import TopKTree

    model, d = (flat_model(), jspec.load_drafter(inner, target=flat_model())) \
        if inner == "early-exit:1" else tiny_eagle3()
    tree = TopKTree(inner=d, k=3, nodes=8, draw=False)
    _assert_lossless(*check_lossless(model, _T1, drafter=tree, length=jspec.FixedLength(K)),
                     min_tau=1.1 if inner == "early-exit:1" else 1.005)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class SharpQ(Lossless):
    """Broken: verifies a drawn tree with q² (renormalised) in place of the q its children
    were drawn from."""

    def verify_tree(self, vstate, key, tokens, parents, depth, valid, target_logits, sampling,
                    max_depth, q=None, q_vocab=None, max_children=0):
        q2 = None if q is None else q * q / jnp.maximum(jnp.sum(q * q, -1, keepdims=True), 1e-30)
        return super().verify_tree(vstate, key, tokens, parents, depth, valid, target_logits,
                                   sampling, max_depth, q=q2, q_vocab=q_vocab,
                                   max_children=max_children)


@pytest.mark.parametrize("sampling,broken", [(_T1, False), (_TOPK, False), (_T1, True)],
                         ids=["T1", "T1-top_k10", "broken-sharp-q"])
def test_drawn_topk_tree_at_t1(sampling, broken):
    """EAGLE-3 trees whose children are drawn from q without replacement (`draw=True`: k = 3,
    8 nodes, depth K = 3), verified by recursive rejection sampling, on the tiny EAGLE-3 at
    T = 1 (and with top-k 10: children of a node whose q has fewer than k tokens left are
    empty). ROWS = 4096 per side, α = 0.01 (Holm over t = 1..4), keys 1 / 2 / 3; τ > 1.25
    (≈ 1.35) at T = 1, > 1.01 with top-k 10 (≈ 1.02: the random drafter's q barely overlaps the
    target's top 10, as in `test_eagle3_real_q`); at T = 1 the same tree walked with its most
    probable children gives ≈ 1.01 (`test_topk_tree_at_t1`). Broken variant: the tree verified
    with q² in place of q is rejected by the same statistic while its A/A control passes."""
    from jspec.drafters.topk_tree import TopKTree

    model, inner = tiny_eagle3()
    tree = TopKTree(inner=inner, k=3, nodes=8, draw=True)
    aa, test, fit, sp = check_lossless(model, sampling, drafter=tree, length=jspec.FixedLength(K),
                                       verifier=SharpQ() if broken else Lossless())
    if broken:
        assert aa.same and not (test.same and fit.same), (aa, test, fit)
    else:
        _assert_lossless(aa, test, fit, sp, min_tau=1.25 if sampling is _T1 else 1.01)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StaleQLookup(LookupFirst):
    """Broken: looked-up rows are verified with the inner drafter's q, not the one-hot of
    their (deterministic) tokens."""

    def draft(self, state, ctx, k, sampling, key):
        inner, _ = self.inner.draft(state, ctx, k, sampling, key)
        prop, state = super().draft(state, ctx, k, sampling, key)
        return dataclasses.replace(prop, q=inner.q), state


@pytest.mark.parametrize("broken,look,tree,outside", [
    (False, 0, None, False), (False, 6, None, False), (False, 6, None, True),
    (False, 6, False, False), (False, 6, True, False), (True, 0, None, False)],
    ids=["lookup", "lookup-look6", "lookup-look6-outside-vocab", "lookup-tree-look6",
         "lookup-drawn-tree-look6", "broken-stale-q"])
def test_lookup_first_at_t1(broken, look, tree, outside):
    """The tiny EAGLE-3 + n-gram lookup (`INNER+ngram:n_min=1`) at T = 1, K = 3: with 1-gram
    matches most rounds look up (the flat target's text repeats single tokens often; PROMPT's
    5, 6, 7 are in the drafter's vocabulary, so round 1 looks up after them), verified with
    empty q rows (deterministic slots, verified as q one-hot at the token); the other rounds
    draft with the real q. `outside-vocab`: 5, 6 and 7 are outside the drafter's vocabulary
    (looked-up chains are still proposed whole; τ > 1.2, ≈ 1.24). ROWS = 4096
    per side, α = 0.01 (Holm over t = 1..4), keys 1 / 2 / 3; τ > 1.2 (≈ 1.26). The broken
    variant (looked-up rows verified with the inner's q) is rejected by the same statistic
    while its A/A control passes. `look6`: looked-up chains of 6 tokens, drafted ones of 3 (two
    verify widths, the q rows past the drafter's chain empty). `tree-look6`: around the top-k
    tree (k 3, 8 nodes, depth 3, its most probable children), looked-up rows propose a 6-token
    chain in the tree's place, walked like the tree (τ > 1.005, ≈ 1.02: the walk accepts a
    node with the target's probability of its token, as in `test_topk_tree_at_t1`).
    `drawn-tree-look6`: the same around a tree drawn from q (`draw=True`), verified by
    recursive rejection sampling, the looked-up chains' empty q rows one-hot in the same
    procedure (τ > 1.25, ≈ 1.35)."""
    from jspec.drafters.topk_tree import TopKTree

    model, inner = (tiny_eagle3(exclude=(5, 6, 7)) if outside  # round 1 looks up "7 5 6"
                    else tiny_eagle3(include=(5, 6, 7)))
    if tree is not None:
        inner = TopKTree(inner=inner, k=3, nodes=8, draw=tree)
    drafter = (StaleQLookup if broken else LookupFirst)(inner=inner, n_min=1, look=look)
    aa, test, fit, sp = check_lossless(model, _T1, drafter=drafter, length=jspec.FixedLength(K))
    if broken:
        assert aa.same and not (test.same and fit.same), (aa, test, fit)
    else:
        _assert_lossless(aa, test, fit, sp, min_tau={None: 1.2, False: 1.005, True: 1.25}[tree])


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ColdWalk(Lossless):
    """Broken: walks the tree along target tokens drawn at temperature 0.7, not the round's."""

    def verify_tree(self, vstate, key, tokens, parents, depth, valid, target_logits, sampling,
                    max_depth):
        return super().verify_tree(vstate, key, tokens, parents, depth, valid, target_logits,
                                   jspec.Sampling(temperature=0.7), max_depth)


def test_broken_tree_walk_is_rejected():
    """The statistic of the tree tests (ROWS = 4096 per side, Holm α = 0.01 over t = 1..4, keys
    1 / 2 / 3; the early-exit:1 top-k tree at T = 1) rejects a walk along target tokens drawn
    at temperature 0.7; the A/A control passes in the same run."""
    from jspec.drafters.topk_tree import TopKTree

    model = flat_model()
    tree = TopKTree(inner=jspec.load_drafter("early-exit:1", target=model), k=3, nodes=8)
    aa, test, fit, _ = check_lossless(model, _T1, drafter=tree, verifier=ColdWalk(),
                                      length=jspec.FixedLength(K))
    assert aa.same, aa
    assert not test.same, f"cold walk was not detected: {test}"
    assert not fit.same, f"cold walk was not detected by the exact fit: {fit}"


# ---------------------------------------------------------------- variants that must fail
@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ResidualFromP(Lossless):
    """Broken: after a rejection, the correction token is drawn from p, not norm([p − q]+)."""

    def verify(self, vstate, key, draft, q, target_logits, sampling, valid, q_vocab=None):
        q = dense_q(q, q_vocab, target_logits.shape[-1])
        n, _ = verify_chain(key, draft, q, target_logits, sampling, valid)
        p = jax.nn.softmax(process_logits(target_logits, sampling), axis=-1)
        nxt = sample_from_probs(jax.random.fold_in(key, 7), p[jnp.arange(n.shape[0]), n])
        return n, nxt, vstate


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class AcceptsTooMuch(Lossless):
    """Broken: accepts with min(1, 2p/q) (and takes the residual of p − q/2)."""

    def verify(self, vstate, key, draft, q, target_logits, sampling, valid, q_vocab=None):
        q = dense_q(q, q_vocab, target_logits.shape[-1])
        n, nxt = verify_chain(key, draft, 0.5 * q, target_logits, sampling, valid)
        return n, nxt, vstate


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Drafts(ChainDrafter):
    """Wraps a drafter. mode "argmax": proposes argmax q but reports q (broken: verification
    assumes x ~ q); mode "one-hot": samples x ~ q but reports no q, so it is verified as a
    one-hot draft (lossless: the residual then removes exactly x; acceptance drops)."""

    inner: jspec.drafters.DraftModel
    mode: str = dataclasses.field(metadata=dict(static=True))

    def init_state(self, *args, **kw):
        return self.inner.init_state(*args, **kw)

    def propose(self, state, ctx, k, sampling, key):
        tokens, q, state = self.inner.propose(state, ctx, k, sampling, key)
        if self.mode == "argmax":
            return jnp.argmax(q, axis=-1).astype(jnp.int32), q, state
        return tokens, None, state


def test_one_hot_verification_of_sampled_drafts_is_lossless_but_accepts_less():
    """x ~ q verified as if q were one-hot at x (early-exit:1, T = 1, K = 3): still exact, at
    a lower acceptance than with the real q. ROWS = 4096 per side, α = 0.01 (Holm over
    t = 1..4), keys 1 / 2 / 3."""
    model = flat_model()
    inner = jspec.load_drafter("early-exit:1", target=model)
    aa, test, fit, sp = check_lossless(model, _T1, drafter=Drafts(inner, "one-hot"),
                                       length=jspec.FixedLength(K))
    _assert_lossless(aa, test, fit, sp, min_tau=1.02)
    real = generate_rows(model, PROMPT, ROWS, batch=ROWS, seed=SPEC_SEED, max_new_tokens=K + 2,
                         sampling=_T1, drafter=inner, length=jspec.FixedLength(K))
    assert real.accepted > 1.2 * sp.accepted, (real.accepted, sp.accepted)


@pytest.mark.parametrize("broken", ["residual-from-p", "accepts-too-much", "argmax-draft"])
def test_broken_variants_are_rejected(broken):
    """The same statistic, sizes, threshold and seeds as the lossless tests (ROWS = 4096 per
    side, Holm α = 0.01 over t = 1..4, keys 1 / 2 / 3; early-exit:1 at T = 1, K = 3) rejects
    three broken verifications: the correction drawn from p, acceptance min(1, 2p/q), and argmax
    drafts verified as if sampled from q. The A/A control passes in the same run."""
    model = flat_model()
    inner = jspec.load_drafter("early-exit:1", target=model)
    kw = {"residual-from-p": dict(drafter=inner, verifier=ResidualFromP()),
          "accepts-too-much": dict(drafter=inner, verifier=AcceptsTooMuch()),
          "argmax-draft": dict(drafter=Drafts(inner, "argmax"))}[broken]
    aa, test, fit, _ = check_lossless(model, _T1, length=jspec.FixedLength(K), **kw)
    assert aa.same, aa
    assert not test.same, f"{broken} was not detected: {test}"
    assert not fit.same, f"{broken} was not detected by the exact fit: {fit}"
