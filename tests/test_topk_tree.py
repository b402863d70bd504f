"""The top-k tree proposer around any chain drafter: the tree it builds, greedy identity with
autoregressive decoding for several inner drafters and budgets, loading, errors, no
recompiles. (Lossless at T = 1: tests/test_distribution.py::test_topk_tree_at_t1.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_second_call_compiles_nothing, tiny_model
from conftest import pad_prompts as _pad
from test_trained_drafters import PROMPTS, tiny_cfg

import jspec
from jspec.drafters import eagle3
from jspec.drafters.topk_tree import TopKTree, top_k_tree
from jspec.errors import JspecError


def _q(rows: list[list[dict[int, float]]], v: int = 10) -> jnp.ndarray:
    q = np.zeros((len(rows), len(rows[0]), v), np.float32)
    for b, r in enumerate(rows):
        for t, d in enumerate(r):
            for tok, p in d.items():
                q[b, t, tok] = p
    return jnp.asarray(q)


def test_tree_layout_budget_and_parents():
    """Chain 1, 2, 3; level 0 also offers 7 (0.3) and 8 (0.1), level 1 offers 6 (0.4), level 2
    offers 5 (0.3). Cumulative scores: 1 .6, 7 .3, 8 .1; 2 .36, 6 .24; 3 .252, 5 .108."""
    q = _q([[{1: 0.6, 7: 0.3, 8: 0.1}, {2: 0.6, 6: 0.4}, {3: 0.7, 5: 0.3}]])
    chain = jnp.asarray([[1, 2, 3]], jnp.int32)
    # temperature 1: q are the drafter's probabilities as they are.
    tok, par = top_k_tree(chain, q, 3, 9, 1.0)
    # Every candidate, level by level (chain token first); a sibling of probability 0 is empty.
    np.testing.assert_array_equal(tok[0], [1, 7, 8, 2, 6, -1, 3, 5, -1])
    np.testing.assert_array_equal(par[0, [0, 1, 2, 3, 4, 6, 7]], [-1, -1, -1, 0, 0, 3, 3])
    # Budget 5: 1, 2, 7, 3, 6 by score, in candidate order; parents renumbered.
    tok, par = top_k_tree(chain, q, 3, 5, 1.0)
    np.testing.assert_array_equal(tok[0], [1, 7, 2, 6, 3])
    np.testing.assert_array_equal(par[0], [-1, -1, 0, 0, 2])
    # Budget 2: the chain's first two tokens (a child never outranks its parent).
    tok, par = top_k_tree(chain, q, 3, 2, 1.0)
    np.testing.assert_array_equal(tok[0], [1, 2])
    np.testing.assert_array_equal(par[0], [-1, 0])
    # k = 1: the chain alone.
    tok, par = top_k_tree(chain, q, 1, 3, 1.0)
    np.testing.assert_array_equal(tok[0], [1, 2, 3])
    np.testing.assert_array_equal(par[0], [-1, 0, 1])
    # A drafter tempered to T = 0.5 reports q ∝ p²: the same tree once undone.
    p = np.asarray(q)
    q2 = p ** 2 / (p ** 2).sum(-1, keepdims=True)
    tok2, par2 = top_k_tree(chain, jnp.asarray(q2), 3, 5, 0.5)
    np.testing.assert_array_equal(par2[0], [-1, -1, 0, 0, 2])
    np.testing.assert_array_equal(tok2[0], [1, 7, 2, 6, 3])


def test_tree_of_a_gapped_chain_and_without_q():
    """A chain that stops (-1 at level 1) has no nodes below the gap; without q (one-hot
    drafts) the tree is the chain."""
    q = _q([[{1: 0.6, 7: 0.4}, {2: 1.0}, {3: 1.0}]])
    tok, _ = top_k_tree(jnp.asarray([[1, -1, 3]], jnp.int32), q, 2, 6, 1.0)
    assert sorted(int(t) for t in tok[0] if t >= 0) == [1, 7]
    tok, par = top_k_tree(jnp.asarray([[4, 5, 6]], jnp.int32), None, 3, 3, 1.0)
    np.testing.assert_array_equal(tok[0], [4, 5, 6])
    np.testing.assert_array_equal(par[0], [-1, 0, 1])


def _eagle3(model):
    cfg = tiny_cfg("eagle3", model)
    vocab = np.sort(np.random.default_rng(0).permutation(model.config.vocab_size)[:64])
    return eagle3.make(cfg, eagle3.init_params(cfg, jax.random.key(3)), vocab, model.weights)


@pytest.mark.parametrize("inner,k,nodes,length", [
    ("early-exit:1", 4, 16, 4), ("early-exit:1", 2, 5, 3), ("ngram", 3, 8, 3),
    ("eagle3", 3, 9, 3)])
def test_greedy_identity(inner, k, nodes, length):
    """T = 0: token-identical to autoregressive decoding; more accepted than the chain alone
    (early-exit), `drafted` counts the tree's nodes."""
    base = tiny_model("llama_tied_gqa2", seed=1)
    model = jspec.Model(config=base.config.replace(eos_ids=()), weights=base.weights)
    d = _eagle3(model) if inner == "eagle3" else jspec.load_drafter(inner, target=model)
    tree = TopKTree(inner=d, k=k, nodes=nodes)
    ids, lens = _pad(PROMPTS)
    ar = jspec.generate(model, ids, lens, max_new_tokens=24)
    sp = jspec.generate(model, ids, lens, max_new_tokens=24, drafter=tree,
                        length=jspec.FixedLength(length))
    np.testing.assert_array_equal(np.asarray(sp.tokens), np.asarray(ar.tokens))
    s = jax.device_get(sp.stats)
    full = min(nodes, k * length) * s.rounds  # `drafted` counts proposed nodes
    assert (s.drafted <= full).all() and (s.accepted <= s.drafted).all()
    if inner == "eagle3":  # proposes every node of the tree in every round
        np.testing.assert_array_equal(s.drafted, full)
    if inner == "early-exit:1":
        chain = jspec.generate(model, ids, lens, max_new_tokens=24, drafter=d,
                               length=jspec.FixedLength(length))
        assert s.accepted.sum() >= np.asarray(chain.stats.accepted).sum()


def test_load_spec_errors_and_no_recompile():
    base = tiny_model("llama_tied_gqa2", seed=1)
    model = jspec.Model(config=base.config.replace(eos_ids=()), weights=base.weights)
    d = jspec.load_drafter("early-exit:1+topk:k=3,nodes=7", target=model)
    assert isinstance(d, TopKTree) and (d.k, d.nodes) == (3, 7) and d.caps.tree
    assert d.caps.lookahead(2) == 6 and d.caps.lookahead(4) == 7
    with pytest.raises(JspecError, match="bad proposer option"):
        jspec.load_drafter("early-exit:1+topk:depth=3", target=model)
    with pytest.raises(JspecError, match="chain drafter"):
        TopKTree(inner=d)
    with pytest.raises(JspecError, match="k must be"):
        TopKTree(inner=d.inner, k=0)
    with pytest.raises(JspecError, match="Lossless"):
        jspec.generate(model, *_pad(PROMPTS), max_new_tokens=4, drafter=d,
                       verifier=jspec.ASD(), length=jspec.FixedLength(2))
    assert_second_call_compiles_nothing(model, PROMPTS, max_new_tokens=8, drafter=d,
                                        length=jspec.FixedLength(3))


@pytest.mark.real
@pytest.mark.slow
def test_real_greedy_eagle3_topk_tree_equals_autoregressive(real_model):
    """The shipped EAGLE-3 as a top-k tree (`smollm2-135m-eagle3+topk`, k = 4, 16 nodes, chain
    K = 4) on two held-out HumanEval prompts, 48 new tokens: output identical to autoregressive,
    and τ within 0.1 of the chain's or above (the tree's chain is drafted at temperature 0.25,
    so at near-ties it may leave the greedy chain)."""
    from jspec.prompts import load_prompt_set

    chain = jspec.load_drafter("smollm2-135m-eagle3", target=real_model)
    tree = jspec.load_drafter("smollm2-135m-eagle3+topk", target=real_model)
    for row in load_prompt_set("humaneval:2"):
        ids = np.asarray([real_model.encode(row["text"])])
        ar = jspec.generate(real_model, ids, max_new_tokens=48)
        sp = jspec.generate(real_model, ids, max_new_tokens=48, drafter=tree,
                            length=jspec.FixedLength(4))
        ch = jspec.generate(real_model, ids, max_new_tokens=48, drafter=chain,
                            length=jspec.FixedLength(4))
        np.testing.assert_array_equal(np.asarray(sp.tokens), np.asarray(ar.tokens))
        assert float(sp.stats.mean_accepted()[0]) >= float(ch.stats.mean_accepted()[0]) - 0.1


def test_tree_from_q_in_the_drafter_vocabulary_equals_the_dense_one():
    """q over a drafter vocabulary (target ids 9, 1, 7, 2, 6, 3, 5, 8: unsorted, as a trained
    drafter's `vocab_ids` may be) builds the same tree as the same q scattered to all V."""
    from jspec.sampling import dense_q

    q = _q([[{1: 0.6, 7: 0.3, 8: 0.1}, {2: 0.6, 6: 0.4}, {3: 0.7, 5: 0.3}]])
    vocab = jnp.asarray([9, 1, 7, 2, 6, 3, 5, 8], jnp.int32)
    q_d = jnp.asarray(np.asarray(q)[..., np.asarray(vocab)])
    np.testing.assert_array_equal(np.asarray(dense_q(q_d, vocab, q.shape[-1])), np.asarray(q))
    chain = jnp.asarray([[1, 2, 3]], jnp.int32)
    for n in (9, 5, 2):
        want = top_k_tree(chain, q, 3, n, 1.0)
        got = top_k_tree(chain, q_d, 3, n, 1.0, q_vocab=vocab)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _aligned_eagle3(model):
    """A tiny EAGLE-3 over the whole vocabulary whose hidden state is mostly the target's last
    feature (fc picks it; the layer adds a small random part): its first drafted token is
    often the target's, so paths are accepted and later trees start from a path's features."""
    import dataclasses

    v, d = model.config.vocab_size, model.config.hidden_size
    cfg = dataclasses.replace(tiny_cfg("eagle3", model), draft_vocab=v)
    p = eagle3.init_params(cfg, jax.random.key(3))
    f = len(cfg.feature_layers)
    fc = jnp.zeros((f * d, d)).at[(f - 1) * d:].set(jnp.eye(d))
    layer = dataclasses.replace(p.layer, wo=p.layer.wo * 0.6, w_down=p.layer.w_down * 0.6)
    p = dataclasses.replace(p, fc=fc, layer=layer)
    return eagle3.make(cfg, p, np.arange(v), model.weights)


def _eagle2_reference(model, drafter, seq, cache_len, depth, k, width, n):
    """The EAGLE-2 tree by brute force: every expanded node's children from the EAGLE-3
    training-time-test forward over the committed tokens followed by the node's path
    (`train_forward`, chain semantics), scores summed along the path, the n best kept.
    Returns one set of paths (token tuples) per row."""
    from test_trained_drafters import _target_features

    from jspec.drafters.trained import draft_logits

    b = seq.shape[0]
    vocab = np.asarray(drafter.vocab_ids)

    def logp(paths):  # paths: one token tuple per row, all of one length l -> f32[B, Vd]
        alt = seq.copy()
        for r in range(b):
            alt[r, cache_len[r] + 1: cache_len[r] + 1 + len(paths[r])] = paths[r]
        feats = _target_features(model, alt, drafter.cfg.feature_layers)
        hs = eagle3.train_forward(drafter.cfg, drafter.params, drafter.embed, jnp.asarray(alt),
                                  feats, steps=len(paths[0]) + 1)
        h = hs[-1][jnp.arange(b), jnp.asarray(cache_len) - 1]
        return np.asarray(jax.nn.log_softmax(draft_logits(drafter.cfg, drafter.params,
                                                          drafter.head, h), axis=-1))

    def children(paths, base):  # [(path, score)] per row for the top-k of each expanded path
        lp = logp(paths)
        out = []
        for r in range(b):
            top = np.argsort(-lp[r], kind="stable")[:k]
            out.append([(paths[r] + (int(vocab[i]),), base[r] + float(lp[r, i])) for i in top])
        return out

    cands = [[] for _ in range(b)]
    frontier = children([()] * b, [0.0] * b)
    for r in range(b):
        cands[r] += frontier[r]
    for _ in range(1, depth):
        best = [sorted(f, key=lambda c: -c[1])[:width] for f in frontier]
        nxt = [[] for _ in range(b)]
        for i in range(width):
            got = children([best[r][i][0] for r in range(b)], [best[r][i][1] for r in range(b)])
            for r in range(b):
                nxt[r] += got[r]
        frontier = nxt
        for r in range(b):
            cands[r] += frontier[r]
    return [{p for p, _ in sorted(c, key=lambda c: (-c[1], len(c[0])))[:n]} for c in cands]


def _paths(tokens, parents):
    out = []
    for tok, par in zip(np.asarray(tokens), np.asarray(parents), strict=True):
        paths = {}
        for i, (t, p) in enumerate(zip(tok, par, strict=True)):
            if t >= 0:
                paths[i] = (paths[p] if p >= 0 else ()) + (int(t),)
        out.append(set(paths.values()))
    return out


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("k,width,nodes,depth", [
    pytest.param(3, 2, 10, 3, marks=pytest.mark.slow), (2, 1, 5, 4),
    pytest.param(3, 3, 30, 3, marks=pytest.mark.slow)])
def test_eagle2_expansion_equals_the_brute_force_tree(k, width, nodes, depth, aligned):
    """The tiny EAGLE-3's EAGLE-2 tree (batched steps over the expanded nodes, tree slots past
    the capacity, ancestor masks) equals a brute-force tree built from the training forward
    along every expanded path, in each of 4 rounds of greedy decoding (4 rows); width 1 is
    the greedy chain plus siblings; 30 nodes is every candidate. A random drafter (its layer
    matters, nothing accepted) and an aligned one (paths accepted)."""
    from jspec.drafters.base import DraftContext
    from jspec.rounds import init_state, speculative_round
    from jspec.verify import Lossless

    base = tiny_model("llama_tied_gqa2", seed=1)
    model = jspec.Model(config=base.config.replace(eos_ids=()), weights=base.weights)
    inner = _aligned_eagle3(model) if aligned else _eagle3(model)
    tree = TopKTree(inner=inner, k=k, nodes=nodes, width=width)
    assert tree.caps.lookahead(depth) == min(nodes, k + (depth - 1) * width * k)
    ids, lens = _pad(PROMPTS)
    sampling = jspec.Sampling()
    st = init_state(model.config, model.weights, tree, jnp.asarray(ids), jnp.asarray(lens),
                    jax.random.key(0), sampling=sampling, max_new_tokens=40, capacity=128,
                    eos_ids=(), k=depth, verifier=Lossless())
    assert st.drafter.ck.shape[2] == 128 + (depth - 1) * width
    rnd = jax.jit(lambda s: speculative_round(model.config, model.weights, tree, s,
                                              policy=jspec.FixedLength(depth), sampling=sampling,
                                              eos_ids=(), verifier=Lossless()))
    for _ in range(4):
        ctx = DraftContext(seq=st.seq, cache_len=st.cache.lengths, last=st.last)
        prop, _ = tree.draft(st.drafter, ctx, depth, sampling, jax.random.key(1))
        got = _paths(prop.tokens, prop.parents)
        want = _eagle2_reference(model, inner, np.asarray(st.seq), np.asarray(st.cache.lengths),
                                 depth, k, width, tree.caps.lookahead(depth))
        assert got == want
        st = rnd(st)
    if aligned:  # paths were accepted: later trees started from several path features
        assert int(np.asarray(st.stats.accepted).sum()) >= 4 * 4


def test_drafter_lists_keep_a_tree_spec_whole():
    """`bench --drafters` lists: a tree spec's own options (commas) stay with it."""
    from jspec.specs import split_list

    assert split_list("e+topk:k=4,nodes=12,width=2@3/4,ngram@3,early-exit:8,ngram:n=3,n_min=2") \
        == ["e+topk:k=4,nodes=12,width=2@3/4", "ngram@3", "early-exit:8", "ngram:n=3,n_min=2"]
    assert split_list("ngram,,smollm2-135m-eagle3@4") == ["ngram", "smollm2-135m-eagle3@4"]
    # An option with nothing before it to attach to is kept as its own (then refused by name).
    assert split_list("k=4,ngram") == ["k=4", "ngram"]


def test_drawn_tree_proposal_errors_and_no_recompile():
    """At T > 0 an EAGLE-3 tree (k 3, width 2, 7 nodes of 15 candidates, depth 3) draws its
    children from q: siblings hold distinct tokens (without replacement), every node's q row
    is its parent's distribution (the root's children: the distribution of the chain's first
    drafted token; siblings share one row), the nodes kept are the first 7 candidates (the
    root's 3 children, then the first expanded node's 3 and one of the second's), and the
    draws change with the key. At T = 0 it is the most probable children, with no q. Bad
    `draw` options are refused; the second sampled call compiles nothing."""
    from jspec.drafters.base import DraftContext
    from jspec.rounds import init_state
    from jspec.verify import Lossless

    base = tiny_model("llama_tied_gqa2", seed=1)
    model = jspec.Model(config=base.config.replace(eos_ids=()), weights=base.weights)
    inner = _eagle3(model)
    tree = TopKTree(inner=inner, k=3, nodes=7, width=2)
    ids, lens = _pad(PROMPTS)
    t1 = jspec.Sampling(temperature=1.0)
    st = init_state(model.config, model.weights, tree, jnp.asarray(ids), jnp.asarray(lens),
                    jax.random.key(0), sampling=t1, max_new_tokens=16, capacity=64, eos_ids=(),
                    k=3, verifier=Lossless())
    ctx = DraftContext(seq=st.seq, cache_len=st.cache.lengths, last=st.last)
    prop, _ = tree.draft(st.drafter, ctx, 3, t1, jax.random.key(1))
    chain, _ = inner.draft(st.drafter, ctx, 1, t1, jax.random.key(2))
    tok, par, q = (np.asarray(a) for a in (prop.tokens, prop.parents, prop.q))
    assert prop.branching == 3 and q.shape == (*tok.shape, 64)
    assert (tok >= 0).all() and (par[:, :3] == -1).all()
    for r in range(tok.shape[0]):
        np.testing.assert_allclose(q[r, :3], np.broadcast_to(np.asarray(chain.q)[r, 0], (3, 64)),
                                   rtol=1e-5, atol=1e-7)
        first, second = par[r, 3], par[r, 6]
        assert first != second and {first, second} <= {0, 1, 2}
        np.testing.assert_array_equal(par[r, 3:6], [first] * 3)
        assert len(set(tok[r, :3])) == 3 and len(set(tok[r, 3:6])) == 3
        np.testing.assert_array_equal(q[r, 3], q[r, 4])
        assert not np.allclose(q[r, 3], q[r, 0]) and not np.allclose(q[r, 6], q[r, 3])
        # Each row is a distribution over the draft vocabulary, which holds every drawn token.
        # (Not that each has mass there: a tail draw at low temperature may have q = 0 in
        # float32, and is verified one-hot; tests/test_exact_law.py.)
        np.testing.assert_allclose(q[r].sum(-1), 1.0, rtol=1e-5)
        assert np.isin(tok[r], np.asarray(inner.vocab_ids)).all()
    again, _ = tree.draft(st.drafter, ctx, 3, t1, jax.random.key(5))
    assert not np.array_equal(np.asarray(again.tokens), tok)
    greedy, _ = tree.draft(st.drafter, ctx, 3, jspec.Sampling(), jax.random.key(1))
    assert greedy.q is None
    walked, _ = TopKTree(inner=inner, k=3, nodes=7, width=2, draw=False).draft(
        st.drafter, ctx, 3, t1, jax.random.key(1))
    assert walked.q is None
    with pytest.raises(JspecError, match="draw must be 0 or 1"):
        jspec.load_drafter("early-exit:1+topk:draw=2", target=model)
    with pytest.raises(JspecError, match="expands trees"):
        jspec.load_drafter("early-exit:1+topk:draw=1", target=model)
    assert not jspec.load_drafter("early-exit:1+topk:draw=0", target=model).draw
    assert_second_call_compiles_nothing(model, PROMPTS, max_new_tokens=8, drafter=tree,
                                        length=jspec.FixedLength(3), sampling=t1)
