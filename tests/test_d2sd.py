"""D²SD: boundary scores, tree layout, the tree walk, greedy identity, KV compaction through
branches, the T=1 distribution, no recompiles, loading and errors."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats as sps
from conftest import pad_prompts as _pad
from conftest import tiny_model
from test_trained_drafters import PROMPTS, tiny_cfg

import jspec
from jspec.drafters import d2sd, dflash
from jspec.drafters.base import Capabilities, ChainDrafter, Proposal
from jspec.drafters.trained import save_drafter
from jspec.verify.tree import walk


@functools.cache
def tiny_d2sd(model_name: str = "llama_tied_gqa2", branch_len: int = 2, branches: int = 4):
    model = tiny_model(model_name, seed=1)
    cfg = tiny_cfg("dflash", model)  # block 6: k <= 5
    vocab = np.sort(np.random.default_rng(0).permutation(model.config.vocab_size)[:64])
    first = dflash.make(cfg, dflash.init_params(cfg, jax.random.key(3)), vocab, model.weights)
    second = dflash.init_params(cfg, jax.random.key(5))
    return model, d2sd.make(first, dataclasses.replace(cfg, kind="d2sd"), second, vocab,
                            model.weights, branches=branches, branch_len=branch_len)


def test_boundary_scores_and_tree_layout():
    conf = jnp.asarray([[0.9, 0.5, 0.8, 0.1]])
    r = np.asarray(d2sd.boundary_scores(conf))[0]
    want = [1 - 0.9, 0.9 * 0.5, 0.9 * 0.5 * 0.2, 0.9 * 0.5 * 0.8 * 0.9]
    np.testing.assert_allclose(r, want, rtol=1e-6)
    parents, depth, valid = d2sd.tree_layout(4, 2, 3, jnp.asarray([[1, 3]]))
    # anchor, chain 1..4, branch at boundary 1 (depths 2, 3, 4), branch at 3 (depth 4; 5, 6 pad)
    np.testing.assert_array_equal(parents[0], [-1, 0, 1, 2, 3, 1, 5, 6, 3, 8, 9])
    np.testing.assert_array_equal(depth[0], [0, 1, 2, 3, 4, 2, 3, 4, 4, 5, 6])
    np.testing.assert_array_equal(valid[0], [True] * 9 + [False] * 2)


def test_walk_follows_the_target_through_branches():
    #        node: 0   1   2   3   4   5   6   7
    tokens = [[9, 10, 11, 12, 20, 21, 30, 0]]
    parents = [[-1, 0, 1, 2, 0, 4, 1, -1]]
    depth = [[0, 1, 2, 3, 1, 2, 2, 9]]
    valid = [[True] * 7 + [False]]
    tt = lambda *x: jnp.asarray([x], jnp.int32)  # noqa: E731
    args = [jnp.asarray(a) for a in (tokens, parents, depth, valid)]
    # target says 10 after the root, then 30 (a branch off node 1), then 77
    n, path, nxt = walk(*args, tt(10, 30, 0, 0, 0, 0, 77, 0), 3)
    assert int(n[0]) == 2 and int(nxt[0]) == 77
    np.testing.assert_array_equal(path[0], [0, 1, 6, 0])
    # 20 after the root (the branch at boundary 0), 21, then 5
    n, path, nxt = walk(*args, tt(20, 0, 0, 0, 21, 5, 0, 0), 3)
    assert int(n[0]) == 2 and int(nxt[0]) == 5
    np.testing.assert_array_equal(path[0], [0, 4, 5, 0])
    # nothing matches: n = 0, the target's token at the root
    n, path, nxt = walk(*args, tt(42, 11, 12, 13, 21, 0, 0, 0), 3)
    assert int(n[0]) == 0 and int(nxt[0]) == 42
    # the whole chain, then the bonus token at node 3
    n, path, nxt = walk(*args, tt(10, 11, 12, 13, 0, 0, 0, 0), 3)
    assert int(n[0]) == 3 and int(nxt[0]) == 13


@pytest.mark.parametrize("model_name,k,branch_len", [
    ("llama_tied_gqa2", 1, 1), ("llama_tied_gqa2", 3, 2), ("llama_tied_gqa2", 5, 3),
    ("llama_untied_mha", 4, 2), ("qwen3_qknorm", 5, 2)])
def test_greedy_identity(model_name, k, branch_len):
    model, drafter = tiny_d2sd(model_name, branch_len)
    ids, lens = _pad(PROMPTS)
    ar = jspec.generate(model, ids, lens, max_new_tokens=24)
    sp = jspec.generate(model, ids, lens, max_new_tokens=24, drafter=drafter,
                        length=jspec.FixedLength(k))
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    s = jax.device_get(sp.stats)
    np.testing.assert_array_equal(s.emitted + 1, np.asarray(sp.lengths))
    # `drafted` counts proposed nodes: at most the tree's, and every accepted one among them.
    assert (s.drafted <= (drafter.tree_size(k) - 1) * s.rounds).all()
    assert (s.accepted <= s.drafted).all() and (s.drafted >= s.rounds).all()
    np.testing.assert_array_equal(s.accepted_at.sum(1), s.accepted)


def test_greedy_identity_pallas_tree_attention():
    model, drafter = tiny_d2sd("llama_tied_gqa2", 2)
    ids, lens = _pad(PROMPTS[:2])
    ar = jspec.generate(model, ids, lens, max_new_tokens=12)
    sp = jspec.generate(model, ids, lens, max_new_tokens=12, drafter=drafter,
                        length=jspec.FixedLength(3), attention_impl="pallas")
    np.testing.assert_array_equal(sp.tokens, ar.tokens)


# ---------------------------------------------------------------------------- fake tree drafters
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OracleTree(ChainDrafter):
    """Knows the greedy continuation `ref`; corrupts chain depth `wrong_at` (0: none) and hangs
    the right continuation on the branch at boundary wrong_at - 1, a wrong one on another: a
    round then accepts through a branch, whose K/V must be moved into place."""

    ref: jax.Array  # i32[B, C] prompt + the target's greedy tokens
    vocab: int = dataclasses.field(metadata=dict(static=True))
    wrong_at: int = dataclasses.field(metadata=dict(static=True))
    branch_len: int = dataclasses.field(metadata=dict(static=True))
    @property
    def caps(self):
        return Capabilities(tree=True, nodes=lambda k: k + 2 * self.branch_len)

    def init_state(self, features, prompt_ids, prompt_lengths, capacity, *, k, verify_width):
        return None

    def draft(self, state, ctx, k, sampling, key):
        c = self.ref.shape[1]
        at = lambda d: jnp.take_along_axis(self.ref, jnp.minimum(ctx.cache_len[:, None] + d,  # noqa: E731
                                                                 c - 1), axis=1)
        chain = at(jnp.arange(1, k + 1)[None])
        if self.wrong_at:
            chain = chain.at[:, self.wrong_at - 1].set((chain[:, self.wrong_at - 1] + 1)
                                                       % self.vocab)
        good = (self.wrong_at or 2) - 1
        b = chain.shape[0]
        bounds = jnp.broadcast_to(jnp.asarray([good, (good + 1) % k], jnp.int32), (b, 2))
        parents, depth, valid = d2sd.tree_layout(k, 2, self.branch_len, bounds)
        toks = at(depth)
        is_br2 = jnp.arange(depth.shape[1]) >= 1 + k + self.branch_len
        toks = jnp.where(is_br2[None], (toks + 3) % self.vocab, toks)
        toks = toks.at[:, 1:k + 1].set(chain).at[:, 0].set(ctx.last)
        return _proposal(toks, parents, valid), None


def _proposal(toks, parents, valid):
    """A D²SD layout (node 0 = `last`) as the Proposal of its drafted nodes."""
    return Proposal(tokens=jnp.where(valid[:, 1:], toks[:, 1:], -1), parents=parents[:, 1:] - 1)


@pytest.mark.parametrize("wrong_at", [0, 1, 3])
def test_acceptance_through_branches_keeps_the_cache_right(wrong_at):
    """Long accepted paths through branch nodes (not contiguous in the tree forward's slots):
    output identical to autoregressive, and τ what the tree allows."""
    base = tiny_model("llama_tied_gqa2", seed=1)
    model = jspec.Model(config=base.config.replace(eos_ids=()), weights=base.weights)
    ids, lens = _pad(PROMPTS)
    n_new, k, ln = 30, 4, 3
    ar = np.asarray(jspec.generate(model, ids, lens, max_new_tokens=n_new).tokens)
    ref = np.zeros((len(PROMPTS), ids.shape[1] + n_new + 16), np.int32)
    for i, p in enumerate(PROMPTS):
        ref[i, : len(p)] = p
        ref[i, len(p): len(p) + n_new] = ar[i]
    drafter = OracleTree(ref=jnp.asarray(ref), vocab=model.config.vocab_size, wrong_at=wrong_at,
                         branch_len=ln)
    sp = jspec.generate(model, ids, lens, max_new_tokens=n_new, drafter=drafter,
                        length=jspec.FixedLength(k))
    np.testing.assert_array_equal(np.asarray(sp.tokens), ar)
    per_round = k + 1 if not wrong_at else (wrong_at - 1) + min(ln, k - wrong_at + 1) + 1
    rounds = np.asarray(sp.stats.rounds)
    np.testing.assert_array_equal(rounds, -(-(n_new - 1) // per_round))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GuessTree(ChainDrafter):
    """Guesses every node uniformly among a few likely tokens (seeded by the round key)."""

    guesses: jax.Array  # i32[G]
    branch_len: int = dataclasses.field(metadata=dict(static=True))
    @property
    def caps(self):
        return Capabilities(tree=True, nodes=lambda k: k + k * self.branch_len)

    def init_state(self, features, prompt_ids, prompt_lengths, capacity, *, k, verify_width):
        return None

    def draft(self, state, ctx, k, sampling, key):
        b = ctx.last.shape[0]
        bounds = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
        parents, _, valid = d2sd.tree_layout(k, k, self.branch_len, bounds)
        pick = jax.random.randint(key, parents.shape, 0, self.guesses.shape[0])
        toks = self.guesses[pick].at[:, 0].set(ctx.last)
        return _proposal(toks, parents, valid), None


def _chi2_two_sample(a: np.ndarray, b: np.ndarray, top: int = 40) -> float:
    vals, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    keep = vals[np.argsort(-counts)[:top]]
    table = np.asarray([[*(np.sum(x == t) for t in keep), len(x) - sum(np.sum(x == t)
                                                                     for t in keep)]
                        for x in (a, b)])
    return sps.chi2_contingency(table[:, table.sum(0) > 0])[1]


def test_distribution_equivalence_t1_tiny_model():
    """T=1: tree decoding vs autoregressive on a tiny model with a spread-out distribution.
    10,240 independent rows per side, one token per row from positions 1..5 (binned by
    (position, token)), seeded; two-sample χ² on the top 40 bins + other: p > 0.01. The
    drafter guesses among the 6 most frequent tokens, so paths run through chain and branch
    nodes alike (τ ≈ 1.12 here: about 5,000 accepted drafted tokens per run). Also the exact
    marginal of the 2nd new token (χ² goodness of fit, p > 0.01)."""
    base = tiny_model("llama_tied_gqa2", seed=5)
    model = jspec.Model(config=base.config.replace(eos_ids=()),
                        weights=dataclasses.replace(base.weights, embed=base.weights.embed * 0.3))
    sampling = jspec.Sampling(temperature=1.0)
    rows, n_new = 10_240, 6
    ids = np.tile(np.asarray([[5, 6, 7, 5, 6, 7, 5, 6]], np.int32), (rows, 1))
    ar = np.asarray(jspec.generate(model, ids, max_new_tokens=n_new, sampling=sampling,
                                   key=jax.random.key(1)).tokens)
    vals, counts = np.unique(ar, return_counts=True)
    guesses = jnp.asarray(vals[np.argsort(-counts)[:6]], jnp.int32)
    sp = jspec.generate(model, ids, max_new_tokens=n_new, sampling=sampling,
                        drafter=GuessTree(guesses=guesses, branch_len=2),
                        length=jspec.FixedLength(4), key=jax.random.key(2))
    assert float(np.mean(sp.stats.mean_accepted())) > 1.08
    spt = np.asarray(sp.tokens)
    r = np.arange(rows)
    pos = 1 + r % 5
    a, b = pos * 1000 + ar[r, pos], pos * 1000 + spt[r, pos]
    assert _chi2_two_sample(a, b) > 0.01
    from jspec.models.cache import KVCache
    from jspec.models.llama import forward
    from jspec.sampling import probs
    v = model.config.vocab_size
    seq0 = jnp.asarray(ids[:1])
    p_len = seq0.shape[1]
    l0 = forward(model.config, model.weights, seq0, jnp.arange(p_len)[None],
                 KVCache.create(model.config, 1, 16)).logits[0, -1]
    seqs = jnp.concatenate([jnp.tile(seq0, (v, 1)), jnp.arange(v)[:, None]], axis=1)
    l1 = forward(model.config, model.weights, seqs, jnp.tile(jnp.arange(p_len + 1)[None], (v, 1)),
                 KVCache.create(model.config, v, 16)).logits[:, -1]
    p2 = np.asarray(probs(l0, sampling) @ probs(l1, sampling), np.float64)
    obs = np.bincount(spt[:, 1], minlength=v)
    mask = p2 * rows >= 5
    exp = np.append(p2[mask] * rows, p2[~mask].sum() * rows)
    ob = np.append(obs[mask], obs[~mask].sum())
    keep = exp > 0
    assert keep.sum() >= 10
    assert sps.chisquare(ob[keep], exp[keep] * ob[keep].sum() / exp[keep].sum())[1] > 0.01


def test_no_recompile_on_second_call():
    model, drafter = tiny_d2sd("llama_tied_gqa2", 2)
    ids, lens = _pad(PROMPTS)
    kw = dict(max_new_tokens=10, length=jspec.FixedLength(3))
    jspec.generate(model, ids, lens, drafter=drafter, **kw).tokens.block_until_ready()
    from jspec.decode import _generate
    before = _generate._cache_size()
    other = dataclasses.replace(drafter, second=dataclasses.replace(
        drafter.second, params=jax.tree.map(lambda v: v * 1.01, drafter.second.params)))
    ids2, lens2 = _pad([[40, 41, 42], [50], [3, 4], [60, 61, 62, 63]])
    jspec.generate(model, ids2, lens2, drafter=other, **kw).tokens.block_until_ready()
    assert _generate._cache_size() == before


def test_load_by_file_options_and_errors(tmp_path):
    model, drafter = tiny_d2sd("llama_tied_gqa2", 2)
    first_path = tmp_path / "first.safetensors"
    save_drafter(first_path, drafter.first.cfg, drafter.first.params,
                 np.asarray(drafter.first.vocab_ids), dtype="float32")
    path = tmp_path / "second.safetensors"
    save_drafter(path, dataclasses.replace(drafter.second.cfg, kind="d2sd"),
                 drafter.second.params, np.asarray(drafter.second.vocab_ids), dtype="float32",
                 extra_metadata={d2sd.META_FIRST: "first.safetensors"})  # relative to the file
    loaded = jspec.load_drafter(f"{path}:branches=2,branch_len=1", target=model)
    assert isinstance(loaded, d2sd.D2SD) and loaded.branches == 2 and loaded.branch_len == 1
    ids, lens = _pad(PROMPTS)
    ar = jspec.generate(model, ids, lens, max_new_tokens=12)
    sp = jspec.generate(model, ids, lens, max_new_tokens=12, drafter=loaded,
                        length=jspec.FixedLength(5))
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    with pytest.raises(jspec.JspecError, match="cut"):
        jspec.load_drafter(f"{path}:cut=0.5", target=model)
    with pytest.raises(jspec.JspecError, match="tree options"):
        jspec.load_drafter(f"{first_path}:branches=2", target=model)
    with pytest.raises(jspec.JspecError, match="branch_len"):
        jspec.load_drafter(f"{path}:branch_len=0", target=model)
    with pytest.raises(jspec.JspecError, match="block"):
        jspec.generate(model, ids, lens, max_new_tokens=8, drafter=loaded,
                       length=jspec.FixedLength(6))
    with pytest.raises(jspec.JspecError, match="Lossless"):
        jspec.generate(model, ids, lens, max_new_tokens=8, drafter=loaded,
                       length=jspec.FixedLength(3), verifier=jspec.ASD())
    save_drafter(tmp_path / "orphan.safetensors", dataclasses.replace(drafter.second.cfg,
                                                                      kind="d2sd"),
                 drafter.second.params, np.asarray(drafter.second.vocab_ids))
    with pytest.raises(jspec.JspecError, match="first drafter"):
        jspec.load_drafter(str(tmp_path / "orphan.safetensors"), target=model)


@pytest.mark.real
@pytest.mark.slow
def test_real_greedy_d2sd_equals_autoregressive(real_model):
    """The shipped D²SD drafter (DFlash first drafter + the fine-tuned variable-prefix one) on
    two held-out HumanEval prompts, 48 new tokens, k = 7: output identical to autoregressive."""
    from jspec.prompts import load_prompt_set

    drafter = jspec.load_drafter("smollm2-135m-d2sd", target=real_model)
    for row in load_prompt_set("humaneval:2"):
        ids = np.asarray([real_model.encode(row["text"])])
        ar = jspec.generate(real_model, ids, max_new_tokens=48)
        sp = jspec.generate(real_model, ids, max_new_tokens=48, drafter=drafter,
                            length=jspec.FixedLength(7))
        np.testing.assert_array_equal(np.asarray(sp.tokens), np.asarray(ar.tokens))
        assert float(sp.stats.mean_accepted()[0]) >= 1.1
