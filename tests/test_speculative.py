"""Speculative decoding core: greedy identity, lossless distributions, caches, batching, jit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from scipy import stats as sps

import jspec
from jspec.decode import _generate
from jspec.drafters import DraftModel, NGram
from jspec.drafters.base import ChainDrafter
from jspec.verify import verify_chain


def _pad(prompts):
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    return ids, np.asarray([len(p) for p in prompts], np.int32)


PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 30, 31, 30]]


def _drafters(model):
    other = tiny_model(model.name, seed=7)  # an independent draft model, same vocabulary
    return {
        "ngram": NGram(n_max=3),
        "early-exit:1": jspec.load_drafter("early-exit:1", target=model),
        "other-model": DraftModel(weights=other.weights, config=other.config),
        "self": DraftModel(weights=model.weights, config=model.config),
    }


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("drafter_name", ["ngram", "early-exit:1", "other-model", "self"])
def test_greedy_speculative_equals_autoregressive(drafter_name, k):
    model = tiny_model("llama_tied_gqa2", seed=1)
    drafter = _drafters(model)[drafter_name]
    ids, lengths = _pad(PROMPTS)
    ar = jspec.generate(model, ids, lengths, max_new_tokens=20)
    sp = jspec.generate(model, ids, lengths, max_new_tokens=20, drafter=drafter,
                        length=jspec.FixedLength(k))
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    np.testing.assert_array_equal(sp.lengths, ar.lengths)
    if drafter_name == "self":
        # The target drafting for itself is always right: every round commits k + 1 tokens
        # (this exercises the draft cache catch-up after full acceptance).
        full_rounds = (np.asarray(ar.lengths) - 1) // (k + 1)
        assert (np.asarray(sp.stats.rounds) <= full_rounds + 1).all()
        assert (np.asarray(sp.stats.accepted_at)[:, -1] >= full_rounds - 1).all()


def test_batch_sizes_give_identical_greedy_results():
    model = tiny_model("qwen2_bias", seed=2)
    drafter = jspec.load_drafter("early-exit:1", target=model)
    prompts = [[3 + i, 4 + 2 * i, 5, 6 + i][: 1 + i % 4] for i in range(8)]
    outs = {}
    for bsz in (1, 3, 8):
        rows = []
        for s in range(0, 8, bsz):
            ids, lengths = _pad(prompts[s:s + bsz])
            o = jspec.generate(model, ids, lengths, max_new_tokens=12, drafter=drafter,
                               length=jspec.FixedLength(3))
            rows.extend(np.asarray(o.tokens))
        outs[bsz] = np.stack(rows)
    np.testing.assert_array_equal(outs[1], outs[3])
    np.testing.assert_array_equal(outs[1], outs[8])


class _Scripted(ChainDrafter):
    """Test drafter: proposes the known greedy continuation with one token corrupted."""

    def __init__(self, reference, wrong_at):
        self.reference = jnp.asarray(reference)  # i32[B, C] prompt + greedy continuation
        self.wrong_at = wrong_at

    def init_state(self, target, prompt_ids, prompt_lengths, capacity, **kw):
        return None

    def propose(self, state, ctx, k, sampling, key):
        idx = ctx.cache_len[:, None] + 1 + jnp.arange(k)[None]
        toks = jnp.take_along_axis(self.reference, jnp.minimum(idx, self.reference.shape[1] - 1),
                                   axis=1)
        toks = toks.at[:, self.wrong_at].set((toks[:, self.wrong_at] + 1) % 97)
        return toks, None, state


jax.tree_util.register_pytree_node(_Scripted, lambda s: ((s.reference,), s.wrong_at),
                                   lambda aux, ch: _Scripted(ch[0], aux))


@pytest.mark.parametrize("wrong_at", [0, 1, 2, 3])
def test_target_cache_consistent_after_rejection_at_each_position(wrong_at):
    model = tiny_model("llama_untied_mha", seed=4)
    prompt = [5, 9, 13, 17]
    ar = jspec.generate(model, np.asarray([prompt], np.int32), max_new_tokens=24)
    ref = np.concatenate([prompt, np.asarray(ar.tokens[0]), np.zeros(16, np.int32)])[None]
    sp = jspec.generate(model, np.asarray([prompt], np.int32), max_new_tokens=24,
                        drafter=_Scripted(ref, wrong_at), length=jspec.FixedLength(4))
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    n = int(sp.lengths[0])
    # Every round accepts exactly `wrong_at` drafts (the rest of the round is the correction).
    acc = np.asarray(sp.stats.accepted_at[0])
    rounds = int(sp.stats.rounds[0])
    assert acc[wrong_at:].sum() == 0
    assert (acc[:wrong_at] >= rounds - 1).all()
    assert n == int(ar.lengths[0])


def test_eos_inside_accepted_prefix_ends_the_row():
    model = tiny_model("llama_tied_gqa2", seed=1)
    ids = np.asarray([[5, 6, 7]], np.int32)
    ar = jspec.generate(model, ids, max_new_tokens=20)
    eos = int(ar.tokens[0, 6])  # make the 7th generated token an EOS
    stop = int(np.nonzero(np.asarray(ar.tokens[0]) == eos)[0][0])
    m2 = jspec.Model(config=model.config.replace(eos_ids=(eos,)), weights=model.weights)
    drafter = DraftModel(weights=model.weights, config=m2.config)  # accepts everything
    sp = jspec.generate(m2, ids, max_new_tokens=20, drafter=drafter, length=jspec.FixedLength(5))
    assert int(sp.lengths[0]) == stop + 1
    np.testing.assert_array_equal(sp.tokens[0, : stop + 1], ar.tokens[0, : stop + 1])
    assert (np.asarray(sp.tokens[0, stop + 1:]) == -1).all()


def test_max_new_tokens_respected_with_long_blocks():
    model = tiny_model("llama_tied_gqa2", seed=1)
    m2 = jspec.Model(config=model.config.replace(eos_ids=()), weights=model.weights)
    drafter = DraftModel(weights=model.weights, config=m2.config)
    for n in (1, 2, 7, 13):
        sp = jspec.generate(m2, np.asarray([[5, 6]], np.int32), max_new_tokens=n, drafter=drafter,
                            length=jspec.FixedLength(5))
        assert int(sp.lengths[0]) == n
        assert (np.asarray(sp.tokens[0]) >= 0).all()


def test_verifier_alone_converges_to_p_with_real_q():
    """K=1: x ~ q, then accept/resample. The emitted token must be distributed as p.

    Sample sizes 2,000 and 200,000, vocabulary 6, seed 0. Threshold: L1 at 200k < 0.02
    (expected ~0.004) and smaller than at 2k.
    """
    v = 6
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(v))
    q = rng.dirichlet(np.ones(v))
    logp = jnp.log(jnp.asarray(p, jnp.float32))
    sampling = jspec.Sampling(temperature=1.0)
    l1 = {}
    for n in (2_000, 200_000):
        kx, kv = jax.random.split(jax.random.key(n))
        x = jax.random.categorical(kx, jnp.log(jnp.asarray(q)), shape=(n,))[:, None]
        qq = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (n, 1, v))
        logits = jnp.broadcast_to(logp, (n, 2, v))
        acc, nxt = verify_chain(kv, x.astype(jnp.int32), qq, logits, sampling)
        tok = np.where(np.asarray(acc) == 1, np.asarray(x[:, 0]), np.asarray(nxt))
        emp = np.bincount(tok, minlength=v) / n
        l1[n] = np.abs(emp - p).sum()
        # Acceptance uses the real q: rate ≈ sum(min(p, q)), not the one-hot rate sum(q p(x)).
        if n == 200_000:
            np.testing.assert_allclose(np.mean(np.asarray(acc)), np.minimum(p, q).sum(), atol=0.01)
    assert l1[200_000] < 0.02
    assert l1[200_000] < l1[2_000]


def _chi2_two_sample(a: np.ndarray, b: np.ndarray, top: int = 30) -> float:
    """p-value of a two-sample χ² test on the `top` most frequent tokens plus an 'other' bin."""
    vals, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    keep = vals[np.argsort(-counts)[:top]]
    def hist(x):
        h = [np.sum(x == t) for t in keep]
        return [*h, len(x) - sum(h)]
    table = np.asarray([hist(a), hist(b)])
    table = table[:, table.sum(0) > 0]
    return sps.chi2_contingency(table)[1]


def _thinned(tokens: np.ndarray, positions: int) -> np.ndarray:
    """One token per row, at drafted position 1 + (row mod positions), encoded with its position.

    Tokens within a row are dependent (tiny random models repeat themselves), which breaks a
    pooled χ² test; one token per row keeps the samples independent.
    """
    rows = np.arange(tokens.shape[0])
    pos = 1 + rows % positions
    return pos * 1000 + tokens[rows, pos]


_T1, _T07P = jspec.Sampling(temperature=1.0), jspec.Sampling(temperature=0.7, top_p=0.9)


@pytest.mark.parametrize("sampling,drafter_name,acceptance_impl", [
    (_T1, "early-exit:1", "xla"), (_T1, "ngram", "xla"),
    pytest.param(_T07P, "early-exit:1", "xla", marks=pytest.mark.slow), (_T07P, "ngram", "xla"),
    # Through the fused Pallas acceptance kernel (interpret mode on CPU; temperature only).
    pytest.param(_T1, "early-exit:1", "pallas", marks=pytest.mark.slow),
    pytest.param(_T1, "ngram", "pallas", marks=pytest.mark.slow),
], ids=lambda v: v if isinstance(v, str) else f"T{v.temperature}-p{v.top_p}")
def test_distribution_equivalence_tiny_model(sampling, drafter_name, acceptance_impl):
    """Speculative vs autoregressive samples on a tiny model: 10,240 independent rows per side,
    one token each from drafted positions 1..5 (binned by (position, token)), seeded; a two-sample
    χ² test (top 40 bins + other) must give p > 0.01. The first drafted position is also compared
    to its exact distribution (χ² goodness of fit, p > 0.01). `acceptance_impl="pallas"` runs the
    verifier through `pallas_kernels.relaxed_acceptance` (same sizes and thresholds)."""
    model = tiny_model("llama_tied_gqa2", seed=5)
    # A flatter output distribution than the default tiny model's, so that many tokens matter.
    weights = dataclasses.replace(model.weights, embed=model.weights.embed * 0.3)
    model = jspec.Model(config=model.config.replace(eos_ids=()), weights=weights)
    drafter = jspec.load_drafter(drafter_name, target=model)
    rows, n_new = 10_240, 6
    ids = np.tile(np.asarray([[5, 6, 7, 5, 6, 7, 5, 6]], np.int32), (rows, 1))
    ar = jspec.generate(model, ids, max_new_tokens=n_new, sampling=sampling, key=jax.random.key(1))
    sp = jspec.generate(model, ids, max_new_tokens=n_new, sampling=sampling, drafter=drafter,
                        length=jspec.FixedLength(4), key=jax.random.key(2),
                        verifier=jspec.Lossless(acceptance_impl=acceptance_impl))
    # Drafts are accepted, not bypassed (the n-gram drafter, one-hot q, on a repetitive prompt).
    assert float(np.mean(sp.stats.mean_accepted())) > (1.3 if drafter_name != "ngram" else 1.005)
    a = _thinned(np.asarray(ar.tokens), 5)
    b = _thinned(np.asarray(sp.tokens), 5)
    assert a.size >= 10_000 and b.size >= 10_000
    assert _chi2_two_sample(a, b, top=40) > 0.01
    # Exact marginal of the 2nd new token (the first one a drafter proposes).
    from jspec.models.cache import KVCache
    from jspec.models.llama import forward
    from jspec.sampling import probs
    v = model.config.vocab_size
    seq0 = jnp.asarray(ids[:1])
    p_len = seq0.shape[1]
    l0 = forward(model.config, model.weights, seq0, jnp.arange(p_len)[None],
                 KVCache.create(model.config, 1, 16)).logits[0, -1]
    p1 = probs(l0, sampling)
    seqs = jnp.concatenate([jnp.tile(seq0, (v, 1)), jnp.arange(v)[:, None]], axis=1)
    l1 = forward(model.config, model.weights, seqs, jnp.tile(jnp.arange(p_len + 1)[None], (v, 1)),
                 KVCache.create(model.config, v, 16)).logits[:, -1]
    p2 = np.asarray(p1 @ probs(l1, sampling), np.float64)
    obs = np.bincount(np.asarray(sp.tokens[:, 1]), minlength=v)
    mask = p2 * rows >= 5  # bins with enough expected mass; the rest pooled
    exp = np.append(p2[mask] * rows, p2[~mask].sum() * rows)
    ob = np.append(obs[mask], obs[~mask].sum())
    keep = exp > 0
    assert keep.sum() >= 10  # the test is only meaningful on a spread-out distribution
    assert sps.chisquare(ob[keep], exp[keep] * ob[keep].sum() / exp[keep].sum())[1] > 0.01


def test_speculative_inside_jit_and_scan_and_no_recompile():
    model = tiny_model("llama_tied_gqa2", seed=1)
    drafter = NGram(n_max=2)
    ids, lengths = _pad(PROMPTS[:2])
    eager = jspec.generate(model, ids, lengths, max_new_tokens=8, drafter=drafter,
                           length=jspec.FixedLength(3))

    @jax.jit
    def user(m, d, ids, lengths):
        return jspec.generate(m, ids, lengths, max_new_tokens=8, drafter=d,
                              length=jspec.FixedLength(3)).tokens

    np.testing.assert_array_equal(user(model, drafter, ids, lengths), eager.tokens)

    def body(c, batch):
        return c, jspec.generate(model, batch[0], batch[1], max_new_tokens=8, drafter=drafter,
                                 length=jspec.FixedLength(3)).tokens

    _, outs = jax.lax.scan(body, 0, (np.stack([ids, ids]), np.stack([lengths, lengths])))
    np.testing.assert_array_equal(outs[0], eager.tokens)

    before = _generate._cache_size()
    ids2, lengths2 = _pad([[40, 41, 42], [50]])
    jspec.generate(model, ids2, lengths2, max_new_tokens=8, drafter=drafter,
                   length=jspec.FixedLength(3)).tokens.block_until_ready()
    assert _generate._cache_size() == before


def test_stats_are_consistent():
    model = tiny_model("llama_tied_gqa2", seed=1)
    ids, lengths = _pad(PROMPTS)
    sp = jspec.generate(model, ids, lengths, max_new_tokens=20, drafter=NGram(),
                        length=jspec.FixedLength(4))
    s = jax.device_get(sp.stats)
    np.testing.assert_array_equal(s.emitted + 1, np.asarray(sp.lengths))  # +1: prefill token
    assert (s.accepted <= s.emitted).all()
    np.testing.assert_array_equal(s.accepted_at.sum(1), s.accepted)
    # `drafted` counts proposed tokens: the n-gram drafter proposes fewer than 4 or abstains in
    # some rounds here (the old count, every verified slot, was 4 a round).
    assert (s.accepted <= s.drafted).all() and (s.drafted <= 4 * s.rounds).all()
    assert (s.drafted < 4 * s.rounds).any()
    # Control: the target drafting for itself proposes 4 every round and all are accepted
    # (21 new tokens = 1 + 4 rounds of 5: no round is cut by max_new_tokens).
    same = jspec.generate(model, ids, lengths, max_new_tokens=21, length=jspec.FixedLength(4),
                          drafter=DraftModel(weights=model.weights, config=model.config))
    t = jax.device_get(same.stats)
    np.testing.assert_array_equal(t.drafted, 4 * t.rounds)
    np.testing.assert_array_equal(t.accepted, t.drafted)


def test_bad_drafter_specs():
    model = tiny_model()
    for bad in ("early-exit:0", "early-exit:2", "early-exit:x", "ngram:n=0", "ngram:q=3",
                "/no/such/dir"):
        with pytest.raises(jspec.JspecError):
            jspec.load_drafter(bad, target=model)
    with pytest.raises(jspec.JspecError, match="k must be"):
        jspec.FixedLength(0)


def test_mismatched_vocabulary_is_a_clear_error(tmp_path):
    from jspec.models.loading import weights_to_hf, write_hf_dir
    model = tiny_model()
    other = tiny_model("llama_mqa_scaled")
    cfg = other.config.replace(vocab_size=101)
    from jspec.models import init_weights
    w = init_weights(cfg, jax.random.key(0))
    write_hf_dir(tmp_path, cfg, weights_to_hf(cfg, w))
    with pytest.raises(jspec.JspecError, match="vocabulary"):
        jspec.load_drafter(tmp_path, target=model)
    # A same-vocabulary directory loads as a DraftModel.
    write_hf_dir(tmp_path / "ok", other.config, weights_to_hf(other.config, other.weights))
    d = jspec.load_drafter(tmp_path / "ok", target=model)
    assert isinstance(d, DraftModel) and d.config.vocab_size == 97
    assert dataclasses.is_dataclass(d)


def test_verifier_invalid_slots_sample_from_p():
    """A slot the drafter left empty (valid=False) is rejected and its token drawn from p.

    200,000 samples, vocabulary 5, seed 0; L1 distance of the emitted token to p < 0.02.
    """
    v, n = 5, 200_000
    p = np.asarray([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (n, 3, v))
    draft = jnp.zeros((n, 2), jnp.int32)  # would be token 0 with q one-hot, if it were valid
    q = jax.nn.one_hot(draft, v)
    valid = jnp.zeros((n, 2), bool)
    acc, nxt = verify_chain(jax.random.key(0), draft, q, logits, jspec.Sampling(temperature=1.0),
                            valid)
    assert int(jnp.max(acc)) == 0
    emp = np.bincount(np.asarray(nxt), minlength=v) / n
    assert np.abs(emp - p).sum() < 0.02
    # Greedy: an invalid slot is never accepted even when the token would match.
    acc, nxt = verify_chain(jax.random.key(0), draft[:4], None, logits[:4], jspec.Sampling(), valid[:4])
    assert int(jnp.max(acc)) == 0 and (np.asarray(nxt) == 0).all()


@pytest.mark.parametrize("k", [1, 3])
def test_every_slot_of_a_block_is_distributed_as_its_own_p(k):
    """K drafted slots with distinct target distributions p_1..p_{K+1} (vocabulary 6, seed 3),
    drafts x_i ~ q_i, 40,000 rows verified at T = 1 in one call (key 21). With q_i = p_i every
    draft is accepted and the bonus token must follow p_{K+1} (not p_K); with a random q_i the
    committed token at each slot i (over the rows that reach it) must follow p_i. χ² goodness of
    fit per slot, each at p > 1e-4 (K+1 tests, ~1e-3 family-wise); the control (q = p) shows a
    one-slot shift is detected: p_K and p_{K+1} are far apart (TV > 0.3)."""
    v, n = 6, 40_000
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.full(v, 0.7), size=k + 1)
    assert 0.5 * np.abs(p[k] - p[k - 1]).sum() > 0.3
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (n, k + 1, v))
    sampling = jspec.Sampling(temperature=1.0)
    for q in (p[:k], rng.dirichlet(np.ones(v), size=k)):
        kx, kv = jax.random.split(jax.random.key(21))
        x = jax.random.categorical(kx, jnp.log(jnp.asarray(q, jnp.float32)), shape=(n, k))
        qq = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (n, k, v))
        acc, nxt = verify_chain(kv, x.astype(jnp.int32), qq, logits, sampling)
        acc, nxt, x = np.asarray(acc), np.asarray(nxt), np.asarray(x)
        for i in range(k + 1):
            reach = acc >= i  # rows whose slot i was decided (accepted draft or next token)
            tok = np.where(acc[reach] > i, x[reach, min(i, k - 1)], nxt[reach])
            if reach.sum() < 500:
                continue
            counts = np.bincount(tok, minlength=v)
            assert sps.chisquare(counts, p[i] * reach.sum()).pvalue > 1e-4, (i, counts)
        if q is p[:k]:
            assert (acc == k).all()  # the bonus slot was reached by every row


def test_committed_sequence_invariant_after_every_round():
    """The state invariant drafters rely on, after each of 6 speculative rounds (n-gram, K = 3,
    greedy, 3 ragged rows): seq[b, :len+1] is the prompt, the generated tokens, nothing else,
    and seq[b, cache.lengths[b]] == last[b]."""
    from jspec.rounds import init_state, make_round

    model = tiny_model("llama_tied_gqa2", seed=1)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11], [20, 21, 20, 21, 20]]
    ids = np.zeros((3, 32), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    drafter = NGram()
    kw = dict(sampling=jspec.Sampling(), eos_ids=(), k=3)
    state = init_state(model.config, model.weights, drafter, jnp.asarray(ids), lens,
                       jax.random.key(0), max_new_tokens=20, capacity=128,
                       verifier=jspec.Lossless(), **kw)
    step = jax.jit(make_round(model.config, model.weights, drafter, verifier=jspec.Lossless(),
                              **kw))
    for _ in range(6):
        state = step(state)
        seq, toks, n, clen, last = (np.asarray(a) for a in (
            state.seq, state.tokens, state.num_new, state.cache.lengths, state.last))
        for b, p in enumerate(prompts):
            want = [*p, *toks[b, : n[b]]]
            assert clen[b] + 1 == len(want)
            np.testing.assert_array_equal(seq[b, : len(want)], want)
            assert seq[b, clen[b]] == last[b] == want[-1]


@pytest.mark.parametrize("sampling", [jspec.Sampling(temperature=1.0), jspec.Sampling()])
@pytest.mark.parametrize("weighted", [False, True])
def test_verify_chain_with_q_in_the_drafter_vocabulary_equals_the_dense_q(sampling, weighted):
    """q over a drafter vocabulary (12 of V = 40 target ids, unsorted) with `q_vocab` gives the
    same accepted counts and next tokens as the same q scattered to all V, for the same keys
    (64 rows x 20 keys); and a one-hot draft (q None) the same as its dense one-hot q. With
    `weighted`, DIVERSED's ν = w·p + (1 − w)·q path."""
    from jspec.sampling import dense_q

    b, k, v = 64, 3, 40
    vocab = jnp.asarray(np.random.default_rng(0).permutation(v)[:12], jnp.int32)
    logits = jax.random.normal(jax.random.key(1), (b, k + 1, v)) * 2.0
    q_d = jax.nn.softmax(jax.random.normal(jax.random.key(2), (b, k, 12)) * 2.0, axis=-1)
    draft = vocab[jax.random.randint(jax.random.key(3), (b, k), 0, 12)]
    valid = jax.random.uniform(jax.random.key(4), (b, k)) < 0.9
    w = jnp.full((b, k), 0.6) if weighted else None
    dense = dense_q(q_d, vocab, v)
    one_hot = jax.nn.one_hot(draft, v, dtype=jnp.float32)
    for s in range(20):
        key = jax.random.key(10 + s)
        got = verify_chain(key, draft, q_d, logits, sampling, valid, w=w, q_vocab=vocab)
        want = verify_chain(key, draft, dense, logits, sampling, valid, w=w)
        for a, c in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
        got = verify_chain(key, draft, None, logits, sampling, valid, w=w)
        want = verify_chain(key, draft, one_hot, logits, sampling, valid, w=w)
        for a, c in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
