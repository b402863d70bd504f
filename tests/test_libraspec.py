"""LibraSpec: the ε rule, Algorithm 1 inside the jitted round, exactness, no recompiles."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from test_speculative import _chi2_two_sample, _thinned
from test_trained_drafters import PROMPTS, _pad, tiny_drafter

import jspec
from jspec.drafters.base import Capabilities, ChainDrafter, Proposal
from jspec.length import LibraSpec, default_widths, epsilon_star, parse_length


def eps_ref(q: list[float], d: int, alpha: float) -> int:
    """ε* straight from ALGORITHMS.md §4 (1-based i, j, k)."""
    best = None
    for i in range(1, d + 1):
        total = sum(math.prod(q[k - 1] for k in range(i, j + 1)) for j in range(i, d + 1))
        e = math.floor(alpha * total + i)
        best = e if best is None else min(best, e)
    return best


def length_ref(q: list[float], n: int, d_max: int, alpha: float) -> int:
    """Algorithm 1: draft n; cut to ε* if ε* <= d, else extend to min(ε*, d_max) and repeat."""
    d = n
    while True:
        e = eps_ref(q, d, alpha)
        if e <= d:
            return e
        if d >= d_max:
            return d
        d = min(e, d_max)


def test_epsilon_star_matches_the_formula():
    rng = np.random.default_rng(0)
    conf = rng.uniform(0, 1, (64, 12)).astype(np.float32)
    conf[:8] = rng.uniform(0.9, 1.0, (8, 12))  # long confident runs
    d = rng.integers(1, 13, 64).astype(np.int32)
    for alpha in (0.5, 2.2, 7.0):
        got = np.asarray(epsilon_star(jnp.asarray(conf), jnp.asarray(d), alpha))
        want = [eps_ref(list(map(float, conf[b])), int(d[b]), alpha) for b in range(64)]
        np.testing.assert_array_equal(got, want)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _ScriptState:
    conf: jax.Array


class _BlockDrafter(ChainDrafter):
    """A block drafter (LibraSpec's kind): proposals carry the state's confidences."""

    @property
    def caps(self) -> Capabilities:
        return Capabilities(block_tokens=self.block)

    def draft(self, state, ctx, k, sampling, key):
        tokens, q, state = self.propose(state, ctx, k, sampling, key)
        return Proposal(tokens=tokens, q=q, conf=state.conf), state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScriptedBlockDrafter(_BlockDrafter):
    """Proposes token 0 with scripted confidences: row b, drafted position t -> table[b, t]."""

    table: jax.Array  # f32[B, T]
    block: int = dataclasses.field(metadata=dict(static=True), default=5)
    name: str = dataclasses.field(metadata=dict(static=True), default="scripted")

    @property
    def block_tokens(self) -> int:
        return self.block

    def init_state(self, target, prompt_ids, prompt_lengths, capacity, **kw):
        return _ScriptState(conf=jnp.zeros((prompt_ids.shape[0], self.block), jnp.float32))

    def propose(self, state, ctx, k, sampling, key):
        c = self.table[:, :k]
        pad = jnp.pad(c, ((0, 0), (0, self.block - k)))  # the carried state keeps one shape
        return jnp.zeros(c.shape, jnp.int32), None, _ScriptState(conf=pad)

    def extend(self, state, ctx, anchor, offset, sampling, key):
        c = jax.lax.dynamic_slice_in_dim(self.table, offset, self.block, axis=1)
        return jnp.zeros(c.shape, jnp.int32), None, c


@pytest.mark.parametrize("n,d_max,alpha", [(4, 12, 2.2), (2, 16, 6.0), (7, 9, 0.7)])
def test_round_chooses_algorithm1_length(n, d_max, alpha):
    """The jitted round (blocks of 5 drafted on demand, while-loop fixed point) verifies exactly
    the length the plain-Python Algorithm 1 picks, per row, for 8 rows of scripted confidences."""
    model = tiny_model("llama_tied_gqa2", seed=1)
    rng = np.random.default_rng(1)
    rows = 8
    table = np.empty((rows, 20), np.float32)
    table[0] = 0.99  # always extends to d_max
    table[1] = 0.01  # cuts at once
    table[2:] = rng.uniform(0.3, 1.0, (rows - 2, 20))
    table[3, 6:] = 0.05  # a cliff after 6 confident positions
    drafter = ScriptedBlockDrafter(jnp.asarray(table))
    ids = np.tile(np.asarray([[3, 4, 5]], np.int32), (rows, 1))
    out = jspec.generate(model, ids, max_new_tokens=2, drafter=drafter,
                         length=LibraSpec(n=n, d_max=d_max, alpha=alpha))
    st = jax.device_get(out.stats)
    assert (st.rounds == 1).all()
    want = [length_ref(list(map(float, table[b])), n, d_max, alpha) for b in range(rows)]
    np.testing.assert_array_equal(st.drafted, want)
    assert st.drafted[1] == 1
    if alpha >= 2:  # confident rows extend to the cap
        assert st.drafted[0] == d_max


@pytest.mark.parametrize("policy", [LibraSpec(n=4, d_max=12, alpha=0.5),
                                    LibraSpec(n=3, d_max=14, alpha=300.0, widths=(2, 6, 14))])
def test_greedy_identity_with_dflash(policy):
    """Greedy LibraSpec output equals autoregressive output; rows choose different lengths."""
    model, drafter = tiny_drafter("dflash")
    ids, lens = _pad(PROMPTS)
    ar = jspec.generate(model, ids, lens, max_new_tokens=24)
    sp = jspec.generate(model, ids, lens, max_new_tokens=24, drafter=drafter, length=policy)
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    st = jax.device_get(sp.stats)
    per_round = st.drafted / np.maximum(st.rounds, 1)
    assert (per_round >= 1).all() and (per_round <= policy.d_max).all()
    assert (st.oracle >= st.accepted).all()  # the oracle is at least what was accepted
    if policy.alpha > 100:
        assert per_round.max() > drafter.block_tokens  # blocks beyond the first were drafted


@pytest.mark.slow  # the exact-marginals test below checks the same exactness by default
def test_distribution_equivalence_libraspec():
    """T=1, tiny model and tiny DFlash drafter, LibraSpec(n=3, d_max=10, α=4) so that rows
    verify different lengths (4..10 with max-probability confidences; α=300 left every row at
    d_max) and extension blocks are drafted: 10,240 independent rows
    per side, one token each from new positions 1..5; two-sample χ² (top 40 bins + other),
    seeded, p > 0.01."""
    model, drafter = tiny_drafter("dflash")
    weights = dataclasses.replace(model.weights, embed=model.weights.embed * 0.3)
    model = jspec.Model(config=model.config.replace(eos_ids=()), weights=weights)
    sampling = jspec.Sampling(temperature=1.0)
    rows, n_new = 10_240, 6
    ids = np.tile(np.asarray([[5, 6, 7, 5, 6, 7, 5, 6]], np.int32), (rows, 1))
    ar = jspec.generate(model, ids, max_new_tokens=n_new, sampling=sampling, key=jax.random.key(1))
    sp = jspec.generate(model, ids, max_new_tokens=n_new, sampling=sampling, drafter=drafter,
                        length=LibraSpec(n=3, d_max=10, alpha=4.0), key=jax.random.key(2))
    st = jax.device_get(sp.stats)
    assert st.accepted.sum() > 0.05 * st.rounds.sum()  # drafts are accepted, not bypassed
    per_round = st.drafted / np.maximum(st.rounds, 1)
    assert per_round.min() < per_round.max()  # lengths differ between rows
    a = _thinned(np.asarray(ar.tokens), 5)
    b = _thinned(np.asarray(sp.tokens), 5)
    assert a.size >= 10_000 and b.size >= 10_000
    assert _chi2_two_sample(a, b, top=40) > 0.01


def test_no_recompile_on_second_call():
    model, drafter = tiny_drafter("dflash")
    ids, lens = _pad(PROMPTS)
    policy = LibraSpec(n=2, d_max=8, alpha=50.0)
    jspec.generate(model, ids, lens, max_new_tokens=12, drafter=drafter, length=policy)
    from jspec.decode import _generate
    before = _generate._cache_size()
    jspec.generate(model, ids[::-1], lens[::-1], max_new_tokens=12, drafter=drafter,
                   length=policy, key=jax.random.key(7))
    assert _generate._cache_size() == before


def test_bad_libraspec_inputs():
    model, drafter = tiny_drafter("dflash")
    _, eagle = tiny_drafter("eagle3")
    ids, lens = _pad(PROMPTS)
    with pytest.raises(jspec.JspecError, match="block drafter"):
        jspec.generate(model, ids, lens, max_new_tokens=4, drafter=eagle, length=LibraSpec())
    with pytest.raises(jspec.JspecError, match="losslessly"):
        jspec.generate(model, ids, lens, max_new_tokens=4, drafter=drafter, length=LibraSpec(),
                       verifier=jspec.ASD())
    for bad in [dict(n=0), dict(n=10, d_max=5), dict(alpha=-1.0), dict(d_max=100),
                dict(d_max=8, widths=(2, 4)), dict(d_max=8, widths=(4, 2, 8))]:
        with pytest.raises(jspec.JspecError):
            LibraSpec(**bad)
    assert parse_length("libraspec") == LibraSpec()
    assert parse_length("libraspec:n=4,d_max=8,alpha=1.5") == LibraSpec(4, 8, 1.5)
    assert parse_length("libraspec:d_max=8,widths=1/3/8").verify_widths == (1, 3, 8)
    assert default_widths(24) == (1, 2, 4, 8, 16, 24)
    for bad in ["libraspec:n", "libraspec:q=3", "libraspec:n=x", "dynamic"]:
        with pytest.raises(jspec.JspecError):
            parse_length(bad)


def test_calibration_algorithm1_and_simulation():
    """calibrate-length's plain Algorithm 1 equals the reference above; its probe records one
    (confidences, oracle) pair per round on a tiny model; with a flat cost curve and free
    drafting the simulation prefers the longest fixed length (more drafted tokens never cost)."""
    from jspec.calibrate import algorithm1, probe, simulate

    rng = np.random.default_rng(3)
    for _ in range(200):
        q = rng.uniform(0, 1, 12)
        n, a = int(rng.integers(1, 13)), float(rng.uniform(0.1, 8))
        assert algorithm1(q, n, 12, a)[0] == length_ref(list(q), n, 12, a)
    model, drafter = tiny_drafter("dflash")
    conf, oracle = probe(model, drafter, [p for p in PROMPTS[:2]], d_max=8, max_new_tokens=12)
    assert conf.shape == (len(oracle), 8) and len(oracle) >= 2
    assert ((oracle >= 0) & (oracle <= 8)).all() and ((conf >= 0) & (conf <= 1)).all()
    flat = {k: 1.0 for k in range(1, 10)}
    sim = simulate(conf, oracle, flat, 0.0, drafter.block_tokens, 8, (1, 2, 4, 8),
                   list(range(1, 9)), [1, 4], [0.5, 2.0])
    best = max(sim["fixed"], key=lambda k: sim["fixed"][k]["speedup"])
    assert sim["fixed"][8]["speedup"] == sim["fixed"][best]["speedup"]
    assert len(sim["libraspec"]) == 4


@pytest.mark.slow
def test_libraspec_on_the_real_model(real_model):
    """Shipped DFlash + LibraSpec (defaults, and a calibrated-style n=4, α=1) on a held-out
    HumanEval prompt: greedy output identical to autoregressive decoding, lengths that vary
    from round to round within [1, d_max], drafts accepted above chance."""
    from jspec.prompts import load_prompt_set

    drafter = jspec.load_drafter("smollm2-135m-dflash", target=real_model)
    ids = np.asarray([real_model.encode(load_prompt_set("humaneval:1")[0]["text"])])
    ar = jspec.generate(real_model, ids, max_new_tokens=48)
    for policy in (LibraSpec(), LibraSpec(n=4, d_max=16, alpha=1.0)):
        sp = jspec.generate(real_model, ids, max_new_tokens=48, drafter=drafter, length=policy)
        np.testing.assert_array_equal(np.asarray(sp.tokens), np.asarray(ar.tokens))
        st = jax.device_get(sp.stats)
        assert 1 <= st.drafted[0] / st.rounds[0] <= policy.d_max
        assert st.drafted[0] != st.rounds[0] * policy.n  # the length was not left at n
        assert float(sp.stats.mean_accepted()[0]) >= 1.1


# --- Exactness at T > 0 with lengths that are cut often --------------------------------------

MARKOV_V = 6


def _rows(*dists: dict[int, float], v: int = MARKOV_V, eps: float = 1e-4) -> np.ndarray:
    """f32[len, V] distributions from {token: mass} dicts, eps elsewhere, renormalised."""
    out = np.full((len(dists), v), eps)
    for r, d in enumerate(dists):
        for t, m in d.items():
            out[r, t] = m
    return (out / out.sum(1, keepdims=True)).astype(np.float32)


def markov_target(trans: np.ndarray) -> tuple[jspec.Model, np.ndarray]:
    """A one-layer model whose next-token distribution depends on the current token only
    (attention and MLP outputs zeroed, one-hot embeddings, an untied head of log-probabilities):
    a Markov chain, so the exact marginal of every generated position is a matrix power.
    Returns (model, P f64[V, V]: P[a, b] = p(next = b | current = a), read off the model)."""
    from jspec.models import ModelConfig, init_weights
    from jspec.models.cache import KVCache
    from jspec.models.llama import forward

    v, d = trans.shape[0], 8
    cfg = ModelConfig(arch="llama", vocab_size=v, hidden_size=d, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=4, ffn_size=8, tie_embeddings=False, eos_ids=())
    w = init_weights(cfg, jax.random.key(0))
    embed = np.zeros((v, d), np.float32)
    embed[np.arange(v), np.arange(v)] = np.sqrt(d)  # RMS 1: the norm keeps it
    head = np.zeros((d, v), np.float32)
    head[:v] = np.log(trans) / np.sqrt(d)
    layer = dataclasses.replace(w.layers[0], wo=jnp.zeros_like(w.layers[0].wo),
                                w_down=jnp.zeros_like(w.layers[0].w_down))
    w = dataclasses.replace(w, embed=jnp.asarray(embed), layers=(layer,),
                            final_norm=jnp.ones((d,), jnp.float32), lm_head=jnp.asarray(head))
    model = jspec.Model(config=cfg, weights=w, name="markov")
    toks = jnp.arange(v, dtype=jnp.int32)[:, None]
    out = forward(cfg, w, toks, jnp.zeros((v, 1), jnp.int32), KVCache.create(cfg, v, 8))
    p = np.asarray(jax.nn.softmax(out.logits[:, 0].astype(jnp.float32), axis=-1), np.float64)
    return model, p


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampledBlockDrafter(_BlockDrafter):
    """A block drafter that samples: slot s of a block anchored on token a is drawn from
    table[s, a] (f32[S, V, V]) through jspec's own `choose` (confidences included). With
    `token_conf` it reports the sampled token's own probability as its confidence instead —
    the rule jspec used before 2026-12-01, kept here as the broken variant the test must catch.
    `temperature` > 0: it draws at that temperature whatever sampling it is handed (so a length
    rule run as for greedy tokens still gets sampled drafts: `NoFloor`)."""

    table: jax.Array  # f32[S, V, V]
    block: int = dataclasses.field(metadata=dict(static=True), default=3)
    token_conf: bool = dataclasses.field(metadata=dict(static=True), default=False)
    temperature: float = dataclasses.field(metadata=dict(static=True), default=0.0)
    name: str = dataclasses.field(metadata=dict(static=True), default="sampled-block")

    @property
    def block_tokens(self) -> int:
        return self.block

    def init_state(self, target, prompt_ids, prompt_lengths, capacity, **kw):
        return _ScriptState(conf=jnp.zeros((prompt_ids.shape[0], self.block), jnp.float32))

    def _draw(self, anchor, offset, k, sampling, key):
        from jspec.drafters.trained import choose

        v = self.table.shape[-1]
        if self.temperature:
            sampling = jspec.Sampling(temperature=self.temperature)
        rows = jax.lax.dynamic_slice_in_dim(self.table, offset, k, axis=0)  # [k, V, V]
        logits = jnp.log(jnp.moveaxis(rows[:, anchor], 0, 1))  # [B, k, V]
        tok, q, conf = choose(logits, jnp.arange(v, dtype=jnp.int32), sampling, key)
        if self.token_conf and q is not None:
            conf = jnp.take_along_axis(q, tok[..., None], axis=-1)[..., 0]
        return tok, q, conf

    def propose(self, state, ctx, k, sampling, key):
        tok, q, conf = self._draw(ctx.last, 0, k, sampling, key)
        return tok, q, _ScriptState(conf=jnp.pad(conf, ((0, 0), (0, self.block - k))))

    def extend(self, state, ctx, anchor, offset, sampling, key):
        return self._draw(anchor, offset, self.block, sampling, key)


def _marginal_pvalues(tokens: np.ndarray, p: np.ndarray, start: int, positions: range
                      ) -> list[float]:
    """Per generated position t, a χ² goodness-of-fit p-value of the tokens at t (over rows)
    against the exact marginal e_start · P^(t+1) (categories with expected count < 5 merged)."""
    from scipy.stats import chisquare

    n = tokens.shape[0]
    dist = np.eye(p.shape[0])[start]
    out = []
    for t in range(positions.stop):
        dist = dist @ p
        if t not in positions:
            continue
        obs = np.bincount(tokens[:, t], minlength=p.shape[0]).astype(np.float64)
        exp = dist / dist.sum() * n
        big = exp >= 5
        o, e = np.append(obs[big], obs[~big].sum()), np.append(exp[big], exp[~big].sum())
        if e[-1] == 0:
            o, e = o[:-1], e[:-1]
        out.append(float(chisquare(o, e * (o.sum() / e.sum())).pvalue))
    return out


def _holm_rejects(pvalues: list[float], alpha: float) -> bool:
    """Holm's step-down test: does any of the hypotheses fall at family-wise level alpha?"""
    ps = sorted(pvalues)
    return any(pv <= alpha / (len(ps) - i) for i, pv in enumerate(ps))


def _cut_case() -> tuple[jspec.Model, np.ndarray, jax.Array]:
    """The audit's toy, as a chain: prompt token 2 -> 0 -> 3 surely; after 3 the target says
    (4, 5) with (0.5, 0.5). The drafter, anchored on 0, proposes 3 surely and then (4, 5) with
    (0.9, 0.1). At α = 0.6 a slot-2 confidence of 0.9 verifies it and 0.1 cuts it: under the
    sampled-token rule the slot-2 token comes out as (0.55, 0.45)."""
    rng = np.random.default_rng(5)
    trans = rng.dirichlet(np.full(MARKOV_V, 0.5), size=MARKOV_V).astype(np.float32)
    trans[[2, 0, 3]] = _rows({0: 1.0}, {3: 1.0}, {4: 0.5, 5: 0.5})
    table = rng.dirichlet(np.full(MARKOV_V, 0.5), size=(4, MARKOV_V)).astype(np.float32)
    table[0, 0], table[1, 0] = _rows({3: 1.0}, {4: 0.9, 5: 0.1})
    model, p = markov_target(trans)
    return model, p, jnp.asarray(table)


def _extend_case() -> tuple[jspec.Model, np.ndarray, jax.Array]:
    """Random peaked chain and drafter tables: at α = 3 rows extend into blocks anchored on
    sampled tokens and are cut again (the floor)."""
    rng = np.random.default_rng(4)
    trans = rng.dirichlet(np.full(MARKOV_V, 0.3), size=MARKOV_V).astype(np.float32)
    table = rng.dirichlet(np.full(MARKOV_V, 0.2), size=(12, MARKOV_V)).astype(np.float32)
    model, p = markov_target(trans)
    return model, p, jnp.asarray(table)


def _floor_case() -> tuple[jspec.Model, np.ndarray, jax.Array]:
    """tests/test_exact_law.py's `floor_case` as a Markov chain (V = 4, every next token
    (0.7, 0.1, 0.1, 0.1)): LibraSpec(n=2, d_max=6, α=4.5) extends d = 2 → 6 past block 2's
    anchor (slot 5), whose confidence then cuts to 5 (floor) or, without the floor, to 4 when
    x_5 ≠ 0: slot 5 verified only when its own token is 0 (exact TV 0.034; position 5's
    token-0 marginal 0.70 → ≈ 0.73)."""
    from test_exact_law import floor_case

    a, table = floor_case()
    model, p = markov_target(np.exp(a).astype(np.float32))
    return model, p, jnp.asarray(np.exp(table), jnp.float32)


@dataclasses.dataclass(frozen=True)
class NoFloor(LibraSpec):
    """Broken: the length rule run as for greedy tokens (no floor), the drafter sampling
    (`SampledBlockDrafter.temperature`): a cut may fall below a block anchored on a sampled
    token (the mutation check's `libraspec-no-floor`)."""

    def draft(self, drafter, dstate, ctx, sampling, key, live):
        from jspec.length import libraspec_draft

        return libraspec_draft(self, drafter, dstate, ctx, jspec.Sampling(), key, live)


def _run(case, policy: LibraSpec, token_conf: bool, key: int, rows: int, drafter: bool = True):
    model, _, table = case
    kw = {}
    if drafter:
        kw = dict(drafter=SampledBlockDrafter(table, token_conf=token_conf, temperature=1.0),
                  length=policy)
    out = jspec.generate(model, np.full((rows, 1), 2, np.int32), max_new_tokens=8,
                         sampling=jspec.Sampling(temperature=1.0), key=jax.random.key(key), **kw)
    st = jax.device_get(out.stats)
    return np.asarray(out.tokens), st.drafted / np.maximum(st.rounds, 1)


def test_libraspec_exact_marginals_when_lengths_are_cut():
    """T = 1, a block drafter that samples (`SampledBlockDrafter`, blocks of 3) and a Markov-
    chain target whose exact marginal at every position is known (prompt: token 2). Two
    cases: the audit's toy (`_cut_case`, LibraSpec(n=2, d_max=4, α=0.6): slot 2 is cut or
    verified by its confidence) and random peaked tables (`_extend_case`, LibraSpec(n=2,
    d_max=8, α=3.0): extension blocks anchored on sampled tokens, then cuts). 20,000
    independent rows per run, seeds 11 (speculative) and 12 (control); per generated position
    1..7 a χ² goodness-of-fit test against the exact marginal, Holm at family-wise 0.001.

    A third case, `_floor_case` (LibraSpec(n=2, d_max=6, α=4.5)): a cut that only the floor
    keeps from falling below block 2's anchor, slot 5.

    Control (can pass): autoregressive decoding of the same chain, same test.
    Broken variants (can fail): the drafter reporting the sampled token's own probability as
    its confidence (jspec's rule before 2026-12-01) is rejected in the toy case (its slot-2
    marginal is (0.55, 0.45) instead of (0.5, 0.5): ~14 standard errors at this N); the length
    rule without its floor (`NoFloor`) is rejected in the floor case (position 5's token 0:
    0.73 instead of 0.70, p ≈ 7e-19; the exact law is off by TV 0.034, tests/test_exact_law.py)."""
    positions, rows = range(1, 8), 20_000
    cut, ext = _cut_case(), _extend_case()
    for case, policy in ((cut, LibraSpec(n=2, d_max=4, alpha=0.6)),
                         (ext, LibraSpec(n=2, d_max=8, alpha=3.0))):
        toks, per_round = _run(case, policy, False, 11, rows)
        assert not _holm_rejects(_marginal_pvalues(toks, case[1], 2, positions), 1e-3)
        assert per_round.min() < per_round.max()  # lengths differ between rows
    assert per_round.max() > 3  # the extend case verified blocks beyond the first
    ar, _ = _run(cut, None, False, 12, rows, drafter=False)
    assert not _holm_rejects(_marginal_pvalues(ar, cut[1], 2, positions), 1e-3)
    bad, _ = _run(cut, LibraSpec(n=2, d_max=4, alpha=0.6), True, 11, rows)
    pv = _marginal_pvalues(bad, cut[1], 2, positions)
    assert _holm_rejects(pv, 1e-3) and pv[1] < 1e-6  # position 2: the toy's slot
    # The floor (`_floor_case`): exact with it; without it position 5 is off.
    floor = _floor_case()
    toks, per_round = _run(floor, LibraSpec(n=2, d_max=6, alpha=4.5), False, 11, rows)
    assert not _holm_rejects(_marginal_pvalues(toks, floor[1], 2, positions), 1e-3)
    bad, bad_per_round = _run(floor, NoFloor(n=2, d_max=6, alpha=4.5), False, 11, rows)
    pv = _marginal_pvalues(bad, floor[1], 2, positions)
    assert _holm_rejects(pv, 1e-3) and pv[4] < 1e-6, pv  # position 5: block 2's anchor
    assert bad_per_round.min() < per_round.min()  # the floor is what kept slot 5
