"""EAGLE-3 and DFlash drafters: inference path == training path, greedy identity, file I/O."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import pad_prompts as _pad
from conftest import tiny_model

import jspec
from jspec.drafters import dflash, eagle3
from jspec.drafters.base import DraftContext
from jspec.drafters.trained import (
    DrafterConfig,
    draft_logits,
    from_flat,
    load_drafter_file,
    save_drafter,
    to_flat,
)
from jspec.models.cache import KVCache
from jspec.models.llama import forward
from jspec.rounds import init_state, speculative_round
from jspec.sampling import Sampling
from jspec.state import features
from jspec.verify import Lossless


def tiny_cfg(kind: str, model) -> DrafterConfig:
    c = model.config
    return DrafterConfig(kind=kind, hidden_size=c.hidden_size, num_heads=4, num_kv_heads=2,
                         head_dim=8, ffn_size=40, num_layers=1 if kind == "eagle3" else 2,
                         feature_layers=(1, 2) if kind == "dflash" else (0, 1, 2),
                         draft_vocab=64, target_vocab=c.vocab_size, rope_theta=c.rope_theta,
                         rms_eps=c.rms_eps, block=4 if kind == "eagle3" else 6, target="tiny")


@functools.cache
def tiny_drafter(kind: str, cut: float = 0.0):
    model = tiny_model("llama_tied_gqa2", seed=1)
    cfg = tiny_cfg(kind, model)
    mod = {"eagle3": eagle3, "dflash": dflash}[kind]
    params = mod.init_params(cfg, jax.random.key(3))
    # Make the verification head non-trivial so that `cut` has something to act on.
    params = dataclasses.replace(
        params, vh_w=0.5 * jax.random.normal(jax.random.key(4), params.vh_w.shape))
    vocab = np.sort(np.random.default_rng(0).permutation(model.config.vocab_size)[:64])
    return model, mod.make(cfg, params, vocab, model.weights, cut=cut)


PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 30, 31, 30]]


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
@pytest.mark.parametrize("k", [1, 3, 5, 8])  # DFlash block 6: k = 8 chains two blocks
def test_greedy_identity(kind, k):
    model, drafter = tiny_drafter(kind)
    ids, lens = _pad(PROMPTS)
    ar = jspec.generate(model, ids, lens, max_new_tokens=24)
    sp = jspec.generate(model, ids, lens, max_new_tokens=24, drafter=drafter,
                        length=jspec.FixedLength(k))
    np.testing.assert_array_equal(sp.tokens, ar.tokens)


def test_vat_cut_keeps_greedy_identity():
    model, drafter = tiny_drafter("eagle3", cut=0.5)
    ids, lens = _pad(PROMPTS)
    ar = jspec.generate(model, ids, lens, max_new_tokens=24)
    sp = jspec.generate(model, ids, lens, max_new_tokens=24, drafter=drafter,
                        length=jspec.FixedLength(3))
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    # Some drafts were withdrawn: fewer drafted tokens verified than 3 per round.
    assert (np.asarray(sp.stats.drafted) <= 3 * np.asarray(sp.stats.rounds)).all()


def _rounds_with_drafts(model, drafter, k, n_rounds):
    """Run speculative rounds one at a time; record (cache_len, drafts) before each round."""
    ids, lens = _pad(PROMPTS)
    sampling = Sampling()
    st = init_state(model.config, model.weights, drafter, jnp.asarray(ids), jnp.asarray(lens),
                    jax.random.key(0), sampling=sampling, max_new_tokens=40, capacity=128,
                    eos_ids=(), k=k, verifier=Lossless())
    rnd = jax.jit(functools.partial(speculative_round, model.config, model.weights, drafter,
                                    policy=jspec.FixedLength(k), sampling=sampling, eos_ids=(),
                                    verifier=Lossless()))
    log = []
    for _ in range(n_rounds):
        ctx = DraftContext(seq=st.seq, cache_len=st.cache.lengths, last=st.last)
        d, _, _ = drafter.propose(st.drafter, ctx, k, sampling, jax.random.key(1))
        log.append((np.asarray(st.cache.lengths), np.asarray(d)))
        st = rnd(st)
    return st, log


def _target_features(model, seq, layers):
    b, s = seq.shape
    cache = KVCache.create(model.config, b, s)
    out = forward(model.config, model.weights, jnp.asarray(seq),
                  jnp.broadcast_to(jnp.arange(s), (b, s)), cache, hidden_layers=layers)
    return features(out.hidden)


def test_eagle3_inference_matches_training_forward():
    """Drafts made round by round (cache + pending features) equal the argmax of the
    training-time-test forward over the final sequence, for every chain start and step."""
    model, drafter = tiny_drafter("eagle3")
    k = 3
    st, log = _rounds_with_drafts(model, drafter, k, 5)
    seq = np.asarray(st.seq)
    # train_forward feeds the given next tokens; inference feeds its own drafts. Per round,
    # give train_forward the committed prefix followed by that round's drafts.
    checked = 0
    for L, d in log:
        alt = seq.copy()
        for b in range(seq.shape[0]):
            alt[b, L[b] + 1: L[b] + 1 + k] = d[b]
        feats = _target_features(model, alt, drafter.cfg.feature_layers)
        hs = eagle3.train_forward(drafter.cfg, drafter.params, drafter.embed, jnp.asarray(alt),
                                  feats, steps=k)
        for b in range(seq.shape[0]):
            for j in range(k):
                logits = draft_logits(drafter.cfg, drafter.params, drafter.head, hs[j][b, L[b] - 1])
                assert int(drafter.vocab_ids[jnp.argmax(logits)]) == int(d[b, j]), (b, j)
                checked += 1
    assert checked == 5 * 4 * k


def test_dflash_inference_matches_training_forward():
    model, drafter = tiny_drafter("dflash")
    k = 5
    st, log = _rounds_with_drafts(model, drafter, k, 5)
    seq = np.asarray(st.seq)
    feats = _target_features(model, seq, drafter.cfg.feature_layers)
    for L, d in log:
        anchors = jnp.asarray(L[:, None])  # the block's anchor sits at position cache_len
        h = dflash.train_forward(drafter.cfg, drafter.params, drafter.embed, jnp.asarray(seq),
                                 feats, anchors, gamma=k + 1)
        logits = draft_logits(drafter.cfg, drafter.params, drafter.head, h[:, 0, 1:])
        np.testing.assert_array_equal(np.asarray(drafter.vocab_ids[jnp.argmax(logits, -1)]), d)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_save_load_roundtrip(tmp_path, kind):
    model, drafter = tiny_drafter(kind)
    path = tmp_path / "d.safetensors"
    save_drafter(path, drafter.cfg, drafter.params, np.asarray(drafter.vocab_ids),
                 dtype="float32")
    cfg, params, vocab = load_drafter_file(path)
    assert cfg == drafter.cfg
    np.testing.assert_array_equal(vocab, np.asarray(drafter.vocab_ids))
    for name, v in to_flat(drafter.params).items():
        np.testing.assert_array_equal(np.asarray(to_flat(params)[name]), np.asarray(v))
    loaded = jspec.load_drafter(str(path), target=model)
    assert loaded.cfg == drafter.cfg


def test_bad_trained_drafter_inputs(tmp_path):
    model, drafter = tiny_drafter("dflash")
    path = tmp_path / "d.safetensors"
    save_drafter(path, drafter.cfg, drafter.params, np.asarray(drafter.vocab_ids))
    other = tiny_model("llama_mqa_scaled")  # hidden 48, not 32
    with pytest.raises(jspec.JspecError, match="hidden size"):
        jspec.load_drafter(str(path), target=other)
    with pytest.raises(jspec.JspecError, match="cut"):
        jspec.load_drafter(f"{path}:cut=1.5", target=model)
    (tmp_path / "x.safetensors").write_bytes(b"not a file")
    with pytest.raises(jspec.JspecError):
        jspec.load_drafter(str(tmp_path / "x.safetensors"), target=model)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_flat_names_round_trip_and_refuse_unknown_or_missing(kind):
    """Parameters are dataclasses; files and interop use their flat names. The round trip is
    the identity (same arrays, same layer structure), and a file with a missing or an extra
    name is refused with the name (never silently dropped or defaulted)."""
    _, drafter = tiny_drafter(kind)
    flat = to_flat(drafter.params)
    assert ("wq" in flat) == (kind == "eagle3") and ("l1.wq" in flat) == (kind == "dflash")
    back = from_flat(kind, flat)
    assert jax.tree.structure(back) == jax.tree.structure(drafter.params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(drafter.params), strict=True):
        assert a is b
    lost = next(n for n in flat if n.endswith("w_down"))
    with pytest.raises(jspec.JspecError, match=lost.replace(".", r"\.")):
        from_flat(kind, {n: a for n, a in flat.items() if n != lost})
    with pytest.raises(jspec.JspecError, match=r"unknown.*l9\.wqq"):
        from_flat(kind, {**flat, "l9.wqq": flat["fc"]})
    with pytest.raises(jspec.JspecError, match="lack 'fc'"):
        from_flat(kind, {n: a for n, a in flat.items() if n != "fc"})


def test_state_is_a_pytree_without_recompiles():
    model, drafter = tiny_drafter("eagle3")
    ids, lens = _pad(PROMPTS)
    jspec.generate(model, ids, lens, max_new_tokens=10, drafter=drafter,
                   length=jspec.FixedLength(2))
    from jspec.decode import _generate
    before = _generate._cache_size()
    jspec.generate(model, ids, lens, max_new_tokens=10, drafter=dataclasses.replace(
        drafter, params=jax.tree.map(lambda v: v * 1.01, drafter.params)),
        length=jspec.FixedLength(2))
    assert _generate._cache_size() == before


@pytest.mark.real
@pytest.mark.parametrize("name,k", [("smollm2-135m-eagle3", 4), ("smollm2-135m-dflash", 7)])
def test_shipped_drafters_on_the_real_model(real_model, name, k):
    """The shipped drafters load by name, keep greedy output identical to autoregressive
    decoding on a held-out HumanEval prompt, and are accepted well above chance (a random
    drafter gives τ ≈ 1.0 here; the trained ones measure 1.4-1.5 on HumanEval)."""
    from jspec.prompts import load_prompt_set

    drafter = jspec.load_drafter(name, target=real_model)
    ids = np.asarray([real_model.encode(load_prompt_set("humaneval:1")[0]["text"])])
    ar = jspec.generate(real_model, ids, max_new_tokens=48)
    sp = jspec.generate(real_model, ids, max_new_tokens=48, drafter=drafter,
                        length=jspec.FixedLength(k))
    np.testing.assert_array_equal(np.asarray(sp.tokens), np.asarray(ar.tokens))
    assert float(sp.stats.mean_accepted()[0]) >= 1.1


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0), Sampling(temperature=0.25),
                                      Sampling(temperature=0.7, top_k=3),
                                      Sampling(temperature=1.3, top_p=0.8),
                                      Sampling(temperature=1.0, top_k=50)])
def test_choose_in_the_draft_vocabulary_equals_the_full_vocabulary(sampling):
    """Draft-vocabulary logits (Vd = 7 here): q must be what temperature / top-k / top-p over
    the full vocabulary (logits NEG outside the draft vocabulary) gives, and every token a
    draft-vocabulary id with q > 0 (the contract a draft-vocabulary sampler must also keep).
    q itself stays in the draft vocabulary ([B, K, Vd]); `dense_q` gives the full one."""
    from jspec.drafters.trained import choose
    from jspec.sampling import NEG, dense_q, probs

    v, vocab = 23, jnp.asarray([2, 3, 5, 7, 11, 13, 17], jnp.int32)
    logits_d = jax.random.normal(jax.random.key(1), (2, 3, 7)) * 2.0
    full = jnp.full((2, 3, v), NEG).at[..., vocab].set(logits_d)
    tok, q_d, conf = choose(logits_d, vocab, sampling, jax.random.key(2))
    assert q_d.shape == (2, 3, 7)
    q = dense_q(q_d, vocab, v)
    np.testing.assert_allclose(np.asarray(q), np.asarray(probs(full, sampling)), atol=1e-6)
    np.testing.assert_allclose(np.asarray(conf), np.asarray(q).max(-1), atol=1e-6)
    assert np.isin(np.asarray(tok), np.asarray(vocab)).all()
    assert (np.take_along_axis(np.asarray(q), np.asarray(tok)[..., None], -1) > 0).all()


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_q_temperature_sharpens_the_sampled_q(kind):
    """With `cfg.q_temperature` s a drafter's q at T > 0 is softmax(z / (T s)): from the same
    state and key, the first position's q of s = 0.5 is the s = 1 q raised to the power 2 and
    renormalised (and differs from it); greedy drafts do not change."""
    model, drafter = tiny_drafter(kind)
    st, _ = _rounds_with_drafts(model, drafter, 3, 2)
    ctx = DraftContext(seq=st.seq, cache_len=st.cache.lengths, last=st.last)
    sharp = dataclasses.replace(drafter, cfg=dataclasses.replace(drafter.cfg, q_temperature=0.5))
    sampling = Sampling(temperature=0.8)
    _, q1, _ = drafter.propose(st.drafter, ctx, 3, sampling, jax.random.key(7))
    _, q2, _ = sharp.propose(st.drafter, ctx, 3, sampling, jax.random.key(7))
    q1, q2 = np.asarray(q1[:, 0], np.float64), np.asarray(q2[:, 0], np.float64)
    want = q1 ** 2 / np.sum(q1 ** 2, axis=-1, keepdims=True)
    np.testing.assert_allclose(q2, want, atol=1e-5)
    assert np.abs(q2 - q1).max() > 1e-2
    g1, _, _ = drafter.propose(st.drafter, ctx, 3, Sampling(), jax.random.key(7))
    g2, _, _ = sharp.propose(st.drafter, ctx, 3, Sampling(), jax.random.key(7))
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g2))


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_bfloat16_decode_holds_no_copy_of_the_embedding_table(kind):
    """A bfloat16 target's compiled speculative decode holds no float32 copy ([V, D]) and no
    transposed copy ([D, V]) of the (tied) embedding table: XLA:CPU made both once per
    `generate` call, hoisted out of the loop, before `blocks.embed_rows` (a 16-bit table
    gathered as its integer bits) and the tied head's two-dimensional product
    (docs/BENCHMARKS.md "Per-call copies of the embedding table"). Fails on the old gathers."""
    from jspec import decode
    from jspec.inputs import pad_to_bucket

    model, _ = tiny_drafter(kind)
    bf = model.astype("bfloat16")
    cfg = tiny_cfg(kind, model)
    mod = {"eagle3": eagle3, "dflash": dflash}[kind]
    vocab = np.sort(np.random.default_rng(0).permutation(model.config.vocab_size)[:64])
    drafter = mod.make(cfg, mod.init_params(cfg, jax.random.key(3)), vocab, bf.weights)
    ids, lengths = _pad(PROMPTS)
    ids = pad_to_bucket(ids)
    st = decode._statics(bf, ids, drafter, jspec.Sampling(), 8, None, jspec.FixedLength(3), None)
    ver = st.pop("verifier")
    hlo = decode._generate.lower(bf.weights, drafter, ver, ids, lengths, jax.random.key(0),
                                 **st).compile().as_text()
    v, d = bf.config.vocab_size, bf.config.hidden_size
    assert f"bf16[{v},{d}]" in hlo  # control: the table itself is there
    assert f"f32[{v},{d}]" not in hlo
    assert f"bf16[{d},{v}]" not in hlo
