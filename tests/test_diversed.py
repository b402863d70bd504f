"""DIVERSED relaxed verification: the rule, its distribution, w = 1 == lossless, heads, errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import pad_prompts as _pad
from conftest import tiny_model
from scipy import stats
from test_trained_drafters import PROMPTS, tiny_drafter

import jspec
from jspec.drafters import DraftModel
from jspec.errors import JspecError
from jspec.sampling import Sampling
from jspec.verify import Diversed, DiversedHead, parse_verifier, verify_chain
from jspec.verify.diversed import ensemble_logprob

V = 6
P = np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
Q = np.array([0.05, 0.10, 0.45, 0.10, 0.20, 0.10])


def _one_position(verifier, w_logits_key, n: int, sampling=Sampling(temperature=1.0)):
    """n independent rounds with K=1 over fixed p, q: (first committed token, n_accepted)."""
    logits = jnp.log(jnp.asarray(np.stack([P, P])))[None]  # [1, 2, V] (position 2: bonus)
    q = jnp.asarray(Q, jnp.float32)[None, None]  # [1, 1, V]

    def one(key):
        k_d, k_v = jax.random.split(key)
        x = jax.random.categorical(k_d, jnp.log(q[0, 0]))[None, None].astype(jnp.int32)
        nacc, nxt, _ = verifier.verify(verifier.init_state(1, 4), k_v, x, q, logits, sampling,
                                       jnp.ones((1, 1), bool))
        return jnp.where(nacc[0] > 0, x[0, 0], nxt[0]), nacc[0]

    keys = jax.random.split(jax.random.key(w_logits_key), n)
    y, nacc = jax.jit(jax.vmap(one))(keys)
    return np.asarray(y), np.asarray(nacc)


@pytest.mark.parametrize("w", [0.0, 0.5, 0.8, 1.0])
def test_committed_token_is_distributed_as_nu(w):
    # 20,000 seeded rounds; χ² goodness of fit to ν = w·p + (1−w)·q at p > 0.001; and the
    # acceptance rate within 4.5 standard errors of 1 − w·TV(p, q).
    n = 20_000
    y, nacc = _one_position(Diversed(weight=w), 7, n)
    nu = w * P + (1 - w) * Q
    counts = np.bincount(y, minlength=V)
    _, pval = stats.chisquare(counts, nu * n)
    assert pval > 1e-3, (counts, nu * n)
    tv = 0.5 * np.abs(P - Q).sum()
    acc = 1 - w * tv
    assert abs(nacc.mean() - acc) < 4.5 * np.sqrt(acc * (1 - acc) / n + 1e-12)


@pytest.mark.parametrize("w", [0.3, 0.7, 1.0])
def test_measurements_match_an_exact_computation(w):
    """K = 3 chains with fixed p_i, q_i (vocabulary 6, seed 0), drafts x_i ~ q_i, 20,000
    rows verified at T = 1 in one call (key 11). Per row, exactly: positions = min(n + 1, K),
    tv_sum = Σ_{i < min(n+1, K)} (1 − w)·TV(p_i, q_i) and w_sum = w·positions, from numpy's TV;
    and the mean accepted count within 4.5 standard errors of its exact value
    Σ_j Π_{i<=j} (1 − w·TV_i)."""
    rng = np.random.default_rng(0)
    b, k = 20_000, 3
    p = rng.dirichlet(np.ones(V), size=k + 1)  # [K+1, V] (the last one: bonus position)
    q = rng.dirichlet(np.ones(V), size=k)
    tv = 0.5 * np.abs(p[:k] - q).sum(-1)  # [K]
    k_d, k_v = jax.random.split(jax.random.key(11))
    draft = jax.random.categorical(k_d, jnp.log(jnp.asarray(q, jnp.float32)), shape=(b, k))
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (b, k + 1, V))
    qq = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (b, k, V))
    ver = Diversed(weight=w)
    n, _, st = ver.verify(ver.init_state(b, 8), k_v, draft.astype(jnp.int32), qq, logits,
                          Sampling(temperature=1.0), jnp.ones((b, k), bool))
    n, st = np.asarray(n), jax.device_get(st)
    decided = np.minimum(n + 1, k)
    np.testing.assert_array_equal(st.positions, decided)
    want = (1 - w) * np.cumsum(np.concatenate([[0.0], tv]))[decided]
    np.testing.assert_allclose(st.tv_sum, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(st.w_sum, w * decided, rtol=1e-6)
    mean_n = np.cumprod(1 - w * tv).sum()
    assert abs(n.mean() - mean_n) < 4.5 * n.std() / np.sqrt(b), (n.mean(), mean_n)


@pytest.mark.parametrize("greedy", [True, False])
def test_weight_one_is_exactly_lossless(greedy):
    rng = np.random.default_rng(0)
    b, k, v = 16, 4, 32
    logits = jnp.asarray(rng.normal(size=(b, k + 1, v)) * 2, jnp.float32)
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, k, v)), jnp.float32), axis=-1)
    draft = jnp.asarray(rng.integers(0, v, size=(b, k)), jnp.int32)
    # Make some drafts the target's argmax so greedy accepts a prefix sometimes.
    draft = jnp.where(jnp.asarray(rng.random((b, k)) < 0.6), jnp.argmax(logits[:, :k], -1), draft)
    valid = jnp.asarray(rng.random((b, k)) < 0.9)
    sampling = Sampling() if greedy else Sampling(temperature=0.8)
    qq = None if greedy else q
    ver = Diversed(weight=1.0)
    for seed in range(5):
        key = jax.random.key(seed)
        n1, t1 = verify_chain(key, draft, qq, logits, sampling, valid)
        n2, t2, _ = ver.verify(ver.init_state(b, 8), key, draft, qq, logits, sampling, valid)
        np.testing.assert_array_equal(n1, n2)
        np.testing.assert_array_equal(t1, t2)


def test_lower_weight_accepts_more_greedy():
    rng = np.random.default_rng(1)
    b, k, v = 64, 4, 32
    logits = jnp.asarray(rng.normal(size=(b, k + 1, v)), jnp.float32)
    draft = jnp.asarray(rng.integers(0, v, size=(b, k)), jnp.int32)
    valid = jnp.ones((b, k), bool)
    ns = []
    for w in (1.0, 0.7, 0.3):
        ver = Diversed(weight=w)
        n, nxt, _ = ver.verify(ver.init_state(b, 8), jax.random.key(0), draft, None, logits,
                                Sampling(), valid)
        ns.append(float(np.mean(n)))
        # The correction token is argmax ν: the target's argmax (one-hot q at a rejected x).
        top = np.asarray(jnp.argmax(logits, -1))
        rej = np.asarray(n) < k
        np.testing.assert_array_equal(np.asarray(nxt)[rej], top[np.arange(b), np.asarray(n)][rej])
    assert ns[0] < ns[1] < ns[2], ns
    # One-hot q: w < 0.5 accepts everything (1 − w > w·max p).
    assert ns[2] == k


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_greedy_weight_one_identical_to_autoregressive(kind):
    model, drafter = tiny_drafter(kind)
    ids, lens = _pad(PROMPTS)
    ar = jspec.generate(model, ids, lens, max_new_tokens=20)
    for ver in (Diversed(weight=1.0), Diversed(head=_head_at(model, drafter, w=1.0))):
        sp = jspec.generate(model, ids, lens, max_new_tokens=20, drafter=drafter,
                            length=jspec.FixedLength(3), verifier=ver)
        np.testing.assert_array_equal(sp.tokens, ar.tokens)


def _head_at(model, drafter, w: float, kind="context") -> DiversedHead:
    """A head whose weight is exactly w everywhere (zero kernel, bias logit(w))."""
    head = DiversedHead.init(kind, drafter.hidden_size, model.config.hidden_size, model="tiny")
    big = 40.0 if w == 1.0 else float(np.log(w / (1 - w)))
    return DiversedHead(kernel=head.kernel, bias=jnp.asarray([0.0, big]), kind=head.kind,
                        d_draft=head.d_draft, d_target=head.d_target, model="tiny")


def test_context_head_at_half_equals_static_half_and_records():
    model, drafter = tiny_drafter("eagle3")
    ids, lens = _pad(PROMPTS)
    s = Sampling(temperature=1.0)
    head = DiversedHead.init("context", drafter.hidden_size, model.config.hidden_size)
    run = functools.partial(jspec.generate, model, ids, lens, max_new_tokens=24, drafter=drafter,
                            length=jspec.FixedLength(3), sampling=s, key=jax.random.key(5))
    a = run(verifier=Diversed(weight=0.5))
    b = run(verifier=Diversed(head=head, record=True))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    st = jax.device_get(b.verifier)
    np.testing.assert_array_equal(st.positions, a.verifier.positions)
    lengths = np.asarray(b.lengths)
    # Inside each row's output the records mark exactly the tokens drawn from ν: every token
    # but token 0 (the prefill's) and the bonus tokens of rounds that accepted all 3 drafts
    # (stats.accepted_at[:, 2] such rounds; the last one's bonus may fall past the end). Records
    # at the wrong slots (e.g. shifted by a round's n + 1) break this count.
    stats = jax.device_get(b.stats)
    for r in range(len(lengths)):
        rel = st.relaxed[r, : lengths[r]]
        assert not rel[0]
        bonus = int(lengths[r]) - 1 - int(rel.sum())
        full = int(stats.accepted_at[r, 2])
        assert full - 1 <= bonus <= full, (r, bonus, full, rel)
        assert (st.tv[r, : lengths[r]][rel] + 1e-6
                >= np.abs(st.p_y[r, : lengths[r]] - st.q_y[r, : lengths[r]])[rel]).all()
    assert st.relaxed.sum() >= 20
    assert (st.p_y[st.relaxed] > 0).all() and (st.p_y[st.relaxed] <= 1 + 1e-6).all()
    assert (st.q_y[st.relaxed] >= 0).all()
    # The recorded tokens' head inputs are non-zero (drafter + target hidden states).
    assert (np.abs(st.feats[st.relaxed]).sum(-1) > 0).all()
    # The policy log-probability is differentiable in the head.
    def lp(h):
        return ensemble_logprob(h, 0.5, jnp.asarray(st.p_y), jnp.asarray(st.q_y),
                                jnp.asarray(st.feats))[0][st.relaxed].sum()
    g = jax.grad(lp)(head)
    assert np.isfinite(np.asarray(g.kernel)).all() and np.abs(np.asarray(g.bias)).sum() > 0


def test_head_arrays_do_not_recompile():
    from jspec.decode import _generate
    model, drafter = tiny_drafter("dflash")
    ids, lens = _pad(PROMPTS)
    s = Sampling(temperature=1.0)
    run = functools.partial(jspec.generate, model, ids, lens, max_new_tokens=12, drafter=drafter,
                            length=jspec.FixedLength(3), sampling=s, key=jax.random.key(0))
    run(verifier=Diversed(head=_head_at(model, drafter, 0.3)))
    before = _generate._cache_size()
    out = run(verifier=Diversed(head=_head_at(model, drafter, 0.9)))
    assert _generate._cache_size() == before
    assert np.asarray(out.lengths).min() > 0


def test_head_save_load_and_mismatch(tmp_path):
    model, drafter = tiny_drafter("eagle3")
    head = _head_at(model, drafter, 0.7)
    path = tmp_path / "h.safetensors"
    head.save(path)
    back = DiversedHead.load(path)
    np.testing.assert_allclose(back.bias, head.bias)
    assert (back.kind, back.d_draft, back.d_target) == ("context", head.d_draft, head.d_target)
    ver = parse_verifier(f"diversed:head={path}")
    assert isinstance(ver, Diversed) and ver.head is not None
    # A head for another target: clear error at generate time.
    other = DiversedHead.init("context", drafter.hidden_size, model.config.hidden_size + 8)
    ids, lens = _pad(PROMPTS)
    with pytest.raises(JspecError, match="target hidden size"):
        jspec.generate(model, ids, lens, max_new_tokens=4, drafter=drafter,
                       verifier=Diversed(head=other), sampling=Sampling(temperature=1.0))
    # A context head with a drafter that has no hidden states.
    with pytest.raises(JspecError, match="hidden states"):
        jspec.generate(model, ids, lens, max_new_tokens=4, drafter=jspec.NGram(),
                       verifier=Diversed(head=head), sampling=Sampling(temperature=1.0))
    with pytest.raises(JspecError, match="not a DIVERSED head"):
        from jspec.drafters.trained import save_drafter
        save_drafter(tmp_path / "d.safetensors", drafter.cfg, drafter.params,
                     np.asarray(drafter.vocab_ids))
        DiversedHead.load(tmp_path / "d.safetensors")


@pytest.mark.parametrize("spec,match", [
    ("diversed:w=1.5", "in \\[0, 1\\]"), ("diversed:w=-0.1", "in \\[0, 1\\]"),
    ("diversed:w=abc", "not a number"), ("diversed:x=1", "expected w=W or head=PATH"),
    ("diversed:head=/nonexistent.safetensors", "not found")])
def test_bad_specs(spec, match):
    with pytest.raises(JspecError, match=match):
        parse_verifier(spec)


def test_parse_static():
    assert parse_verifier("diversed:w=0.7") == Diversed(weight=0.7)
    assert parse_verifier("diversed").weight == 0.5


@pytest.mark.real
@pytest.mark.slow
def test_diversed_on_the_real_model(real_model):
    """SmolLM2-135M with the shipped EAGLE-3 drafter, a held-out math prompt (batch of 4 rows):
    w = 1 at T=0 is token-identical to autoregressive greedy; at T=1 (seeded, 4 rows x 48
    tokens) w = 0.5 accepts a larger fraction of drafted tokens than lossless verification,
    and its measured TV agrees with its acceptance: each decided slot i is accepted with
    probability 1 − w·TV_i, so Σ accepted − Σ_i (1 − w·TV_i) has mean 0 and variance at most
    positions / 4, where Σ_i TV_i = tv_sum / (1 − w) (tv_sum accumulates (1 − w)·TV); the
    threshold is 4.5 of those standard deviations. This relies on finished rows adding nothing
    to `positions` and `tv_sum` (as `stats.accepted` counts live rounds only)."""
    from jspec.prompts import load_prompt_set

    drafter = jspec.load_drafter("smollm2-135m-eagle3", target=real_model)
    ids = np.asarray([real_model.encode(load_prompt_set("math:1")[0]["text"])] * 4)
    ar = jspec.generate(real_model, ids[:1], max_new_tokens=32)
    sp = jspec.generate(real_model, ids[:1], max_new_tokens=32, drafter=drafter,
                        length=jspec.FixedLength(4), verifier=Diversed(weight=1.0))
    np.testing.assert_array_equal(np.asarray(sp.tokens), np.asarray(ar.tokens))
    s = Sampling(temperature=1.0)
    rates = {}
    for w in (1.0, 0.5):
        out = jspec.generate(real_model, ids, max_new_tokens=48, drafter=drafter,
                             length=jspec.FixedLength(4), sampling=s, key=jax.random.key(3),
                             verifier=Diversed(weight=w))
        st = jax.device_get(out.stats)
        rates[w] = st.accepted.sum() / st.drafted.sum()
        if w < 1.0:
            vs = jax.device_get(out.verifier)
            positions = int(vs.positions.sum())
            expected = positions - w / (1.0 - w) * float(vs.tv_sum.sum())
            assert positions >= 100, positions
            assert abs(int(st.accepted.sum()) - expected) < 4.5 * 0.5 * np.sqrt(positions), (
                int(st.accepted.sum()), expected, positions)
    assert rates[0.5] > rates[1.0] + 0.05, rates


def test_fused_acceptance_kernel_path_matches_xla():
    """Diversed(acceptance_impl="pallas") at T=1 (interpret mode here) returns exactly the XLA
    path's n and tokens given the same key, for a static w and a scalar head."""
    rng = np.random.default_rng(3)
    b, k, v = 8, 3, 256
    logits = jnp.asarray(rng.normal(size=(b, k + 1, v)), jnp.float32)
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, k, v)), jnp.float32), axis=-1)
    draft = jnp.asarray(rng.integers(0, v, size=(b, k)), jnp.int32)
    valid = jnp.ones((b, k), bool)
    s = Sampling(temperature=1.0)
    scalar = DiversedHead(kernel=jnp.zeros((0, 2)), bias=jnp.asarray([0.0, 0.4]), kind="scalar")
    for ver in (Diversed(weight=0.6), Diversed(head=scalar)):
        fused = Diversed(head=ver.head, weight=ver.weight, acceptance_impl="pallas")
        for seed in range(3):
            key = jax.random.key(seed)
            n1, t1, _ = ver.verify(ver.init_state(b, 4), key, draft, q, logits, s, valid)
            n2, t2, _ = fused.verify(fused.init_state(b, 4), key, draft, q, logits, s, valid)
            np.testing.assert_array_equal(n1, n2)
            np.testing.assert_array_equal(t1, t2)


def _teacher_forced_probs(model, prompt: list[int], out: list[int]) -> np.ndarray:
    """f32[len(out)]: p(out[t] | prompt + out[:t]) under the target at T = 1 (one forward)."""
    from jspec.models.cache import KVCache
    from jspec.models.llama import forward

    seq = jnp.asarray([prompt + out], jnp.int32)
    n = seq.shape[1]
    res = forward(model.config, model.weights, seq, jnp.arange(n, dtype=jnp.int32)[None],
                  KVCache.create(model.config, 1, n + 8))
    p = jax.nn.softmax(res.logits[0].astype(jnp.float32), axis=-1)  # [n, V]
    pos = len(prompt) - 1 + np.arange(len(out))
    return np.asarray(p[pos, np.asarray(out)])


def test_records_belong_to_their_own_tokens():
    """record=True at T = 1 (tiny EAGLE-3, K = 3, w = 0.5, seed 5): every recorded p(y) is the
    target's probability of the token committed at that index, recomputed by a teacher-forced
    forward of the output (records used to land n+1 slots late); records and TV sit inside each
    row's output, and q(y) > 0 wherever the committed token was an accepted draft."""
    model, drafter = tiny_drafter("eagle3")
    ids, lens = _pad(PROMPTS)
    out = jspec.generate(model, ids, lens, max_new_tokens=24, drafter=drafter,
                         length=jspec.FixedLength(3), sampling=Sampling(temperature=1.0),
                         verifier=Diversed(weight=0.5, record=True), key=jax.random.key(5))
    st = jax.device_get(out.verifier)
    toks, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    assert st.relaxed.sum() >= 20
    for b, prompt in enumerate(PROMPTS):
        emitted = [int(t) for t in toks[b, : lengths[b]]]
        want = _teacher_forced_probs(model, prompt, emitted)
        rec = np.flatnonzero(st.relaxed[b])
        assert (rec < lengths[b]).all() and 0 not in rec  # token 0 comes from the prefill
        np.testing.assert_allclose(st.p_y[b, rec], want[rec], rtol=1e-4, atol=1e-6)
        assert (st.q_y[b, rec] >= 0).all() and (st.tv[b, rec] > 0).all()


@pytest.mark.parametrize("cut", ["eos", "max_new_tokens"])
def test_records_stop_where_the_output_stops(cut):
    """A drafter that is the target itself (every draft accepted, greedy, K = 5): a row that ends
    inside a round — at an EOS that is the 3rd token (a drafted slot of round 1), or at
    max_new_tokens = 8 — records DIVERSED measurements only for tokens in its output (slots
    past the end used to be recorded)."""
    model = tiny_model("llama_tied_gqa2", seed=1)
    ids = np.asarray([[5, 6, 7]], np.int32)
    ar = np.asarray(jspec.generate(model, ids, max_new_tokens=20).tokens[0])
    eos, n_max = (int(ar[2]), 20) if cut == "eos" else (-5, 8)
    m2 = jspec.Model(config=model.config.replace(eos_ids=(eos,) if eos >= 0 else ()),
                     weights=model.weights)
    out = jspec.generate(m2, ids, max_new_tokens=n_max, length=jspec.FixedLength(5),
                         drafter=DraftModel(weights=model.weights, config=m2.config),
                         verifier=Diversed(weight=0.5, record=True))
    st, n = jax.device_get(out.verifier), int(out.lengths[0])
    assert n == (int(np.flatnonzero(ar == eos)[0]) + 1 if cut == "eos" else n_max)
    rec = np.flatnonzero(st.relaxed[0])
    assert len(rec) > 0 and rec.max() < n
    assert int(st.positions[0]) == len(rec) and int(out.stats.accepted[0]) < n


def test_finished_rows_stop_adding_to_measurements():
    """A row that ends early (EOS) adds nothing more to DIVERSED's per-row sums or ASD's
    calibration records: greedy, tiny EAGLE-3, K = 3, an EOS chosen so that one row stops within
    its first 4 tokens while another row runs to max_new_tokens."""
    model, drafter = tiny_drafter("eagle3")
    ids, lens = _pad(PROMPTS)
    free = np.asarray(jspec.generate(model, ids, lens, max_new_tokens=24).tokens)
    pick = None
    for r in range(len(PROMPTS)):
        for t in free[r, 1:4]:
            others = [o for o in range(len(PROMPTS)) if o != r and t not in free[o]]
            if others:
                pick = (r, int(t), others[0])
                break
        if pick:
            break
    assert pick is not None
    r, eos, full = pick
    model = jspec.Model(config=model.config.replace(eos_ids=(eos,)), weights=model.weights)
    k = 3
    run = functools.partial(jspec.generate, model, ids, lens, max_new_tokens=24, drafter=drafter,
                            length=jspec.FixedLength(k))
    dv = run(verifier=Diversed(weight=0.5))
    st, stats = jax.device_get(dv.verifier), jax.device_get(dv.stats)
    assert int(dv.lengths[r]) <= 4 and int(dv.lengths[full]) == 24
    assert (st.positions <= stats.rounds * k).all()  # at most k decided slots per live round
    assert st.positions[r] <= int(dv.lengths[r])
    asd = run(verifier=jspec.ASD(record=True))
    sa, stats = jax.device_get(asd.verifier), jax.device_get(asd.stats)
    assert int(asd.lengths[r]) <= 4
    assert (sa.n_ratios <= stats.rounds).all()  # one record per live round at most
