"""`INNER+ngram`: a chain drafter that gives way to the n-gram lookup where the text repeats —
which rows take the lookup, its empty q rows (deterministic slots), greedy identity
with autoregressive decoding, loading, errors, no recompiles. (Lossless at T = 1:
tests/test_distribution.py::test_lookup_first_at_t1.)"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_second_call_compiles_nothing, tiny_model
from conftest import pad_prompts as _pad
from test_trained_drafters import PROMPTS, tiny_drafter

import jspec
from jspec.drafters.base import ChainDrafter, DraftContext
from jspec.drafters.ngram import LookupFirst, NGram
from jspec.errors import JspecError


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Fixed(ChainDrafter):
    """Always proposes 90, 91, 92, ... with a uniform q over `vocab` when sampling."""

    vocab: tuple[int, ...] = ()

    @property
    def q_vocab(self):
        return jnp.asarray(self.vocab, jnp.int32) if self.vocab else None

    def init_state(self, features, prompt_ids, prompt_lengths, capacity, *, k=0, verify_width=0):
        return None

    def propose(self, state, ctx, k, sampling, key):
        b = ctx.seq.shape[0]
        tokens = jnp.broadcast_to(90 + jnp.arange(k, dtype=jnp.int32), (b, k))
        vq = len(self.vocab) or 97
        q = None if sampling.greedy else jnp.full((b, k, vq), 1.0 / vq)
        return tokens, q, state


def _ctx(rows: list[list[int]]) -> DraftContext:
    c = max(map(len, rows)) + 4
    seq = np.zeros((len(rows), c), np.int32)
    for i, r in enumerate(rows):
        seq[i, : len(r)] = r
    lens = np.asarray([len(r) for r in rows], np.int32)
    return DraftContext(seq=jnp.asarray(seq), cache_len=jnp.asarray(lens - 1),
                        last=jnp.asarray(seq[np.arange(len(rows)), lens - 1]))


def test_rows_that_repeat_take_the_lookup_the_others_the_inner_chain():
    """Row 0 ends in "5 6", seen before: "7 5 6" (n_min 2). Row 1 never repeats; row 2 repeats
    only its last token (a 1-gram: below n_min 2, the inner chain; with n_min 1, the lookup).
    Sampling: q rows are empty on looked-up rows (deterministic slots), the inner's
    elsewhere; a looked-up chain is kept whole when its tokens lie outside the inner q
    vocabulary."""
    ctx = _ctx([[5, 6, 7, 5, 6], [9, 10, 11, 12], [3, 4, 3]])
    d = LookupFirst(inner=Fixed())
    greedy, t1 = jspec.Sampling(), jspec.Sampling(temperature=1.0)
    prop, _ = d.draft(None, ctx, 3, greedy, jax.random.key(0))
    np.testing.assert_array_equal(prop.tokens, [[7, 5, 6], [90, 91, 92], [90, 91, 92]])
    assert prop.q is None
    prop, _ = LookupFirst(inner=Fixed(), n_min=1).draft(None, ctx, 3, greedy, jax.random.key(0))
    np.testing.assert_array_equal(prop.tokens[2], [4, 3, 4])  # "3 4 3" goes on periodically
    prop, _ = d.draft(None, ctx, 3, t1, jax.random.key(0))
    q = np.asarray(prop.q)
    np.testing.assert_array_equal(prop.tokens[0], [7, 5, 6])
    np.testing.assert_array_equal(q[0], 0.0)
    np.testing.assert_allclose(q[1:], 1.0 / 97)
    vocab = tuple(v for v in range(97) if v not in (6, 7))  # 7 and 6 are outside: no cut
    prop, _ = LookupFirst(inner=Fixed(vocab=vocab)).draft(None, ctx, 3, t1, jax.random.key(0))
    np.testing.assert_array_equal(prop.tokens[0], [7, 5, 6])
    np.testing.assert_array_equal(np.asarray(prop.q)[0], 0.0)
    np.testing.assert_allclose(np.asarray(prop.q)[1], 1.0 / 95)


def test_longer_looked_up_chains():
    """`look=5` at k = 3: a looked-up row proposes 5 tokens (as many as are known), the inner
    chain 3 and then nothing (-1, q rows of zeros); the round verifies 5 only when a live row
    looked one up (`need`), else 3, and a drafter that may abstain keeps width 0."""
    ctx = _ctx([[5, 6, 7, 8, 9, 10, 5, 6], [9, 10, 11, 12]])
    d = LookupFirst(inner=Fixed(), look=5)
    assert d.caps.lookahead(3) == 5 and d.caps.path_len(3) == 5 and d.caps.lookahead(7) == 7
    prop, _ = d.draft(None, ctx, 3, jspec.Sampling(), jax.random.key(0))
    np.testing.assert_array_equal(prop.tokens, [[7, 8, 9, 10, 5], [90, 91, 92, -1, -1]])
    prop, _ = d.draft(None, _ctx([[1, 5, 6, 5, 6]]), 3, jspec.Sampling(), jax.random.key(0))
    np.testing.assert_array_equal(prop.tokens, [[5, 6, 5, 6, 5]])  # period 2, read on
    prop, _ = d.draft(None, ctx, 3, jspec.Sampling(temperature=1.0), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(prop.q)[1, 3:], 0.0)
    policy = jspec.FixedLength(3)
    assert policy.verify_widths_for(d.caps) == (3, 5)
    assert policy.draft_sizes(d.caps) == (3, 5)
    assert policy.verify_widths_for(LookupFirst(inner=Fixed()).caps) == (3,)
    assert policy.verify_widths_for(LookupFirst(inner=NGram(), look=5).caps) == (0, 3, 5)
    for live, need in [([True, True], 5), ([False, True], 3), ([False, False], 0)]:
        *_, got = policy.draft(d, None, ctx, jspec.Sampling(), jax.random.key(0),
                               jnp.asarray(live))
        assert int(got) == need, (live, got)
    with pytest.raises(JspecError, match="look must be"):
        LookupFirst(inner=Fixed(), look=-1)
    with pytest.raises(JspecError, match="chain drafter"):  # its chains are not k long
        LookupFirst(inner=d)


def test_lookup_around_a_tree():
    """`INNER+topk+ngram:look=4` at depth k = 2: a looked-up row proposes its 4-token chain as
    the tree whose node t has parent t - 1, padded to the tree's node budget (the chain-only
    top-k tree of `Fixed`'s chain: k 3, 6 nodes), the other rows keep their trees; two verify
    widths (the looked-up chain's 4, a tree's 6: the smallest the live rows need), paths up to
    4 tokens."""
    from jspec.drafters.topk_tree import TopKTree

    ctx = _ctx([[5, 6, 7, 8, 9, 10, 5, 6], [9, 10, 11, 12]])
    tree = TopKTree(inner=Fixed(), k=3, nodes=6)
    d = LookupFirst(inner=tree, look=4)
    c = d.caps
    assert c.tree and c.lookahead(2) == 6 and c.path_len(2) == 4
    assert c.lookahead(1) == 4 and c.path_len(5) == 5  # the chain's nodes where more
    greedy = jspec.Sampling()
    alone, _ = tree.draft(None, ctx, 2, greedy, jax.random.key(0))
    prop, _ = d.draft(None, ctx, 2, greedy, jax.random.key(0))
    np.testing.assert_array_equal(prop.tokens[0], [7, 8, 9, 10, -1, -1])
    np.testing.assert_array_equal(prop.parents[0, :4], [-1, 0, 1, 2])
    np.testing.assert_array_equal(prop.tokens[1], alone.tokens[1])
    np.testing.assert_array_equal(prop.parents[1], alone.parents[1])
    policy = jspec.FixedLength(2)
    assert policy.verify_widths_for(c) == (4, 6) and policy.draft_sizes(c) == (2, 4)
    for live, need in [([True, True], 6), ([True, False], 4), ([False, False], 0)]:
        *_, got = policy.draft(d, None, ctx, greedy, jax.random.key(0), jnp.asarray(live))
        assert int(got) == need, (live, got)
    # A tree smaller than the looked-up chain: widths the other way round.
    small = LookupFirst(inner=TopKTree(inner=Fixed(), k=2, nodes=3, width=1), look=4).caps
    assert policy.verify_widths_for(small) == (3, 4)
    # Without look the looked-up chain is the tree's depth, the node budget unchanged.
    c0 = LookupFirst(inner=tree).caps
    assert c0.tree and c0.lookahead(2) == 6 and c0.path_len(2) == 2
    assert policy.verify_widths_for(c0) == (2, 6)
    prop, _ = LookupFirst(inner=tree).draft(None, ctx, 2, greedy, jax.random.key(0))
    np.testing.assert_array_equal(prop.tokens[0], [7, 8, -1, -1, -1, -1])


def test_lookup_outside_the_draft_vocabulary_inside_a_drawn_tree():
    """At T = 1 inside an EAGLE-3 tree drawn from q (`+topk` k 2, width 2, 4 nodes,
    `+ngram:look=4`): a looked-up chain whose tokens lie outside the draft vocabulary is kept
    whole with empty q rows, which the tree's verification reads as deterministic nodes (as a
    chain's does); the other row keeps its drawn tree and q."""
    from jspec.drafters.topk_tree import TopKTree
    from jspec.rounds import init_state
    from jspec.verify import Lossless

    model, inner = tiny_drafter("eagle3")
    vocab = set(np.asarray(inner.vocab_ids).tolist())
    a, b = sorted(vocab)[5:7]
    out = [t for t in range(1, model.config.vocab_size) if t not in vocab][:2]
    rows = [[a, b, out[0], out[1], a, out[0], a, b], [a, b, out[0]]]  # row 1: no repeat
    ids, lens = _pad(rows)
    t1 = jspec.Sampling(temperature=1.0)
    d = LookupFirst(inner=TopKTree(inner=inner, k=2, nodes=4, width=2), look=4)
    st = init_state(model.config, model.weights, d, jnp.asarray(ids), jnp.asarray(lens),
                    jax.random.key(0), sampling=t1, max_new_tokens=8, capacity=32, eos_ids=(),
                    k=2, verifier=Lossless())
    ctx = _ctx(rows)  # the committed text: the rows (the drafter's state is the prompts')
    prop, _ = d.draft(st.drafter, ctx, 2, t1, jax.random.key(1))
    np.testing.assert_array_equal(prop.tokens[0], [out[0], out[1], a, out[0]])
    np.testing.assert_array_equal(prop.parents[0], [-1, 0, 1, 2])
    assert float(jnp.abs(prop.q[0]).sum()) == 0.0
    assert prop.tokens[1, 0] >= 0 and float(prop.q[1, 0].sum()) > 0.99
    chain = LookupFirst(inner=inner, look=4)
    cp, _ = chain.draft(st.drafter, ctx, 2, t1, jax.random.key(1))
    np.testing.assert_array_equal(cp.tokens[0], [out[0], out[1], a, out[0]])


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_lookup_around_a_tree_greedy_identity(kind):
    """Greedy decoding with `INNER+topk:k=2,nodes=4+ngram:look=6` at depth 2 is
    token-identical to autoregressive decoding (EAGLE-3 expands the tree EAGLE-2 style, DFlash
    gives the chain-only tree), and some round accepts more than the tree's depth: the
    drafter's state takes the looked-up paths."""
    from jspec.drafters.topk_tree import TopKTree

    model, inner = tiny_drafter(kind)
    ids, lens = _pad(PROMPTS)
    ar = jspec.generate(model, ids, lens, max_new_tokens=24)
    d = LookupFirst(inner=TopKTree(inner=inner, k=2, nodes=4, width=2 if kind == "eagle3"
                                   else 0), look=6)
    out = jspec.generate(model, ids, lens, drafter=d, max_new_tokens=24,
                         length=jspec.FixedLength(2))
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    at = np.asarray(out.stats.accepted_at)
    assert at.shape[1] == 6 and at[:, 2:].sum() > 0, at


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_longer_looked_up_chains_greedy_identity(kind):
    """Greedy decoding with `+ngram:look=6` at k = 2 is token-identical to autoregressive
    decoding, and some round accepts more than the drafter's 2 tokens (the tiny target repeats
    itself): the drafter's state takes paths longer than its own chains."""
    model, inner = tiny_drafter(kind)
    ids, lens = _pad(PROMPTS)
    ar = jspec.generate(model, ids, lens, max_new_tokens=24)
    out = jspec.generate(model, ids, lens, drafter=LookupFirst(inner=inner, look=6),
                         max_new_tokens=24, length=jspec.FixedLength(2))
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    at = np.asarray(out.stats.accepted_at)
    assert at.shape[1] == 6 and at[:, 2:].sum() > 0, at


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identity(kind, k):
    """Greedy decoding with a trained drafter + lookup is token-identical to autoregressive
    decoding (the drafter's features follow whichever chain was accepted); the lookup does
    change the rounds (the tiny target repeats itself)."""
    model, inner = tiny_drafter(kind)
    ids, lens = _pad(PROMPTS)
    ar = jspec.generate(model, ids, lens, max_new_tokens=16)
    kw = dict(max_new_tokens=16, length=jspec.FixedLength(k))
    alone = jspec.generate(model, ids, lens, drafter=inner, **kw)
    both = jspec.generate(model, ids, lens, drafter=LookupFirst(inner=inner), **kw)
    np.testing.assert_array_equal(both.tokens, ar.tokens)
    np.testing.assert_array_equal(alone.tokens, ar.tokens)
    assert not np.array_equal(both.stats.rounds, alone.stats.rounds)
    assert int(np.sum(both.stats.accepted)) > 0


def test_load_spec_errors_and_no_recompile():
    base = tiny_model("llama_tied_gqa2", seed=1)
    model = jspec.Model(config=base.config.replace(eos_ids=()), weights=base.weights)
    d = jspec.load_drafter("early-exit:1+ngram:n_min=3", target=model)
    assert isinstance(d, LookupFirst) and (d.n_min, d.n_max) == (3, 3)
    assert d.name == "early-exit:1+ngram" and not d.caps.tree
    assert not d.caps.may_abstain  # the inner drafter never abstains, nor does the wrapper
    # Placed on a mesh like its inner drafter (heads kept whole).
    assert jspec.sharding.head_dim_of(d) == model.config.head_dim
    assert jspec.load_drafter("early-exit:1+ngram", target=model).n_min == 2
    assert jspec.load_drafter("early-exit:1+ngram:n_min=4", target=model).n_max == 4
    with pytest.raises(JspecError, match="n_min <= n_max"):
        jspec.load_drafter("early-exit:1+ngram:n_min=0", target=model)
    with pytest.raises(JspecError, match="chain drafter"):  # its chains are not k long
        jspec.load_drafter("early-exit:1+ngram:look=4+ngram", target=model)
    with pytest.raises(JspecError, match="chain drafter"):  # a tree takes chains only
        jspec.load_drafter("early-exit:1+topk+topk", target=model)
    assert jspec.load_drafter("early-exit:1+topk+ngram", target=model).caps.tree
    with pytest.raises(JspecError, match="bad proposer option"):
        jspec.load_drafter("early-exit:1+ngram:k=3", target=model)
    assert jspec.load_drafter("early-exit:1+ngram:look=5", target=model).caps.lookahead(2) == 5
    assert_second_call_compiles_nothing(model, PROMPTS, max_new_tokens=8, drafter=d,
                                        length=jspec.FixedLength(3))
