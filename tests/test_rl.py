"""`generate` inside an RL loop (issue 58): log-probs of the emitted tokens, keys, a drafter
re-bound to updated weights, and nothing switched silently inside a user's jit."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import pad_prompts, tiny_model

import jspec
from jspec.models import KVCache, forward
from jspec.sampling import process_logits

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11], [20, 21, 22, 23, 20, 21]]
GREEDY = jspec.Sampling()
TOP_K = jspec.Sampling(temperature=1.0, top_k=5)
TOP_P = jspec.Sampling(temperature=0.8, top_p=0.9)


def teacher_forced_logprobs(model: jspec.Model, ids: np.ndarray, lens: np.ndarray,
                            tokens: np.ndarray, n: np.ndarray, sampling: jspec.Sampling
                            ) -> np.ndarray:
    """f32[B, N]: log p of each generated token from one forward over prompt + completion
    (right-padded; causal, so padding never reaches an earlier position), 0 past each row's
    end. Independent of the decode path: log_softmax of the processed logits."""
    b, width = tokens.shape[0], ids.shape[1] + tokens.shape[1]
    seq = np.zeros((b, width), np.int32)
    for r in range(b):
        seq[r, :lens[r]] = ids[r, :lens[r]]
        seq[r, lens[r]:lens[r] + n[r]] = tokens[r, :n[r]]
    pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width))
    cache = KVCache.create(model.config, b, width)
    logits = forward(model.config, model.weights, jnp.asarray(seq), pos, cache).logits
    logp = np.asarray(jax.nn.log_softmax(process_logits(logits, sampling), axis=-1))
    out = np.zeros(tokens.shape, np.float32)
    for r in range(b):
        for i in range(n[r]):
            out[r, i] = logp[r, lens[r] + i - 1, tokens[r, i]]
    return out


CASES = [
    pytest.param(None, GREEDY, id="plain-greedy", marks=pytest.mark.slow),
    pytest.param(None, TOP_K, id="plain-topk"),
    pytest.param("ngram", GREEDY, id="ngram-greedy"),
    pytest.param("early-exit:1", TOP_P, id="chain-topp"),
    pytest.param("early-exit:1", TOP_K, id="chain-topk", marks=pytest.mark.slow),
    pytest.param("early-exit:1+topk:k=2,nodes=4", GREEDY, id="tree-greedy",
                 marks=pytest.mark.slow),
    pytest.param("early-exit:1+topk:k=2,nodes=4", TOP_P, id="tree-topp"),
]


@pytest.mark.parametrize("spec,sampling", CASES)
def test_logprobs_equal_a_teacher_forced_recomputation(spec, sampling):
    """`GenerateOutput.logprobs`, read from the passes that chose each token (prefill, verify
    blocks, one-token steps), equals log p under the processed target distribution from a
    teacher-forced forward (float32); 0 after each row's end."""
    model = tiny_model()
    ids, lens = pad_prompts(PROMPTS)
    kw = {} if spec is None else dict(drafter=jspec.load_drafter(spec, target=model),
                                      length=jspec.FixedLength(3))
    out = jspec.generate(model, ids, lens, max_new_tokens=12, sampling=sampling,
                         key=jax.random.key(4), **kw)
    tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
    lp = np.asarray(out.logprobs)
    assert lp.shape == tokens.shape and lp.dtype == np.float32
    if spec is not None:  # speculation committed several tokens in some rounds
        assert int(np.asarray(out.stats.accepted).sum()) > 0
    want = teacher_forced_logprobs(model, ids, lens, tokens, n, sampling)
    np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-5)
    assert np.all(lp <= 1e-6)
    for r in range(len(PROMPTS)):
        assert np.all(lp[r, n[r]:] == 0.0)


def test_sampling_without_a_key_is_an_error():
    """At T > 0 a missing key is an error naming the fix (no silent key(0) in a loop); greedy
    decoding draws nothing and needs none."""
    model = tiny_model()
    ids, lens = pad_prompts(PROMPTS[:1])
    with pytest.raises(jspec.JspecError, match=r"key=jax\.random\.key"):
        jspec.generate(model, ids, lens, max_new_tokens=4, sampling=TOP_K)
    with pytest.raises(jspec.JspecError, match="PRNG key"):
        next(jspec.stream(model, ids, lens, max_new_tokens=4, sampling=TOP_K))
    jspec.generate(model, ids, lens, max_new_tokens=4)


def test_plain_fallback_inside_a_users_jit_is_explicit():
    """Past the drafter's measured max_batch, a traced call does not switch to plain decoding
    silently: an error names both choices; either choice then runs."""
    model = tiny_model()
    ids, lens = pad_prompts(PROMPTS)
    d = jspec.NGram(max_batch=1)

    def run(**kw):
        return jax.jit(lambda i, n: jspec.generate(model, i, n, max_new_tokens=4,
                                                   **kw).tokens)(ids, lens)

    with pytest.raises(jspec.JspecError, match=r"length=jspec\.FixedLength.*drafter=None"):
        run(drafter=d)
    spec = run(drafter=d, length=jspec.FixedLength(2))
    np.testing.assert_array_equal(np.asarray(spec), np.asarray(run()))


def test_context_mesh_inside_a_users_jit_is_explicit():
    """Inside a user's jit under `jax.set_mesh`, mesh=None is an error naming the fix;
    mesh=<the Mesh> shards by the rules, mesh=False pins nothing; both give the same tokens."""
    model = tiny_model()
    ids, lens = pad_prompts(PROMPTS)
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:1])
    ref = jspec.generate(model, ids, lens, max_new_tokens=4)

    def run(**kw):
        return jax.jit(lambda i, n: jspec.generate(model, i, n, max_new_tokens=4,
                                                   **kw).tokens)(ids, lens)

    with jax.set_mesh(mesh):
        with pytest.raises(jspec.JspecError, match="mesh=False"):
            run()
        for m in (mesh, False):
            np.testing.assert_array_equal(np.asarray(run(mesh=m)), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(run()), np.asarray(ref.tokens))  # no context


def test_generate_output_is_a_pytree_with_logprobs():
    out = jax.eval_shape(lambda: jspec.generate(tiny_model(), np.asarray([[5, 6]], np.int32),
                                                max_new_tokens=3))
    assert out.logprobs.shape == (1, 3) and out.logprobs.dtype == jnp.float32
    assert dataclasses.is_dataclass(out)


def _build(kind: str, weights, model_name: str):
    """A drafter of `kind` built for a target with `weights` (fixed drafter parameters)."""
    from test_trained_drafters import tiny_cfg

    from jspec.drafters import d2sd, dflash, eagle3

    model = dataclasses.replace(tiny_model(model_name, seed=1), weights=weights)
    if kind == "early-exit":
        return jspec.load_drafter("early-exit:1", target=model)
    if kind == "early-exit+topk":
        return jspec.load_drafter("early-exit:1+topk:k=2,nodes=4", target=model)
    cfg = tiny_cfg("dflash" if kind == "d2sd" else kind, model)
    mod = eagle3 if kind == "eagle3" else dflash
    vocab = np.sort(np.random.default_rng(0).permutation(model.config.vocab_size)[:64])
    d = mod.make(cfg, mod.init_params(cfg, jax.random.key(3)), vocab, weights)
    if kind == "d2sd":
        d = d2sd.make(d, dataclasses.replace(cfg, kind="d2sd"),
                      dflash.init_params(cfg, jax.random.key(5)), vocab, weights)
    return d


def _assert_same_drafter(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("model_name", ["llama_tied_gqa2", "llama_untied_mha"])
@pytest.mark.parametrize("kind", ["eagle3", "dflash", "d2sd", "early-exit", "early-exit+topk"])
def test_bound_drafter_equals_a_freshly_built_one(kind, model_name):
    """`jspec.bind` (jitted) after a weight update == the drafter built for the new weights;
    tensors an imported checkpoint brought itself stay; n-gram is returned as it is."""
    old = tiny_model(model_name, seed=1).weights
    new = tiny_model(model_name, seed=2).weights
    stale = _build(kind, old, model_name)
    bound = jax.jit(jspec.bind)(stale, new)
    _assert_same_drafter(bound, _build(kind, new, model_name))
    if kind == "eagle3":  # its own head (an imported EAGLE-3 lm_head) is not the target's
        own = dataclasses.replace(stale, head=stale.head + 1.0, own_head=True)
        b = jspec.bind(own, new)
        np.testing.assert_array_equal(np.asarray(b.head), np.asarray(own.head))
        np.testing.assert_array_equal(np.asarray(b.embed), np.asarray(new.embed))
    ngram = jspec.NGram()
    assert jspec.bind(ngram, new) is ngram


def test_rebinding_inside_a_users_jit_does_not_recompile():
    """One jitted RL-style step (bind -> sampled speculative generate -> log-probs) with the
    weights and the per-row limit as arguments: other weights and limits compile nothing, and
    the rollout equals the same step given a drafter built for those weights."""
    base = tiny_model("llama_tied_gqa2", seed=1)
    ids, lens = pad_prompts(PROMPTS)
    stale = jspec.load_drafter("early-exit:1", target=base)

    @functools.partial(jax.jit, static_argnames="rebind")
    def step(w, d, key, lim, rebind=True):
        m = dataclasses.replace(base, weights=w)
        out = jspec.generate(m, ids, lens, max_new_tokens=8, sampling=TOP_K, key=key, limit=lim,
                             drafter=jspec.bind(d, w) if rebind else d,
                             length=jspec.FixedLength(3))
        return out.tokens, out.logprobs.sum()

    key = jax.random.key(11)
    step(base.weights, stale, key, jnp.int32(8))
    size = step._cache_size()
    new = tiny_model("llama_tied_gqa2", seed=2)
    tokens, _ = step(new.weights, stale, key, jnp.int32(6))
    assert step._cache_size() == size
    assert np.all((np.asarray(tokens) >= 0).sum(axis=1) <= 6)
    fresh = jspec.load_drafter("early-exit:1", target=new)
    want, _ = step(new.weights, fresh, key, jnp.int32(6), rebind=False)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want))


@pytest.mark.parametrize("spec", [None, "early-exit:1"])
def test_limit_is_dynamic_per_row(spec):
    """`limit=` (dynamic, per row) cuts each row at its value below the static
    max_new_tokens: greedy tokens are the unlimited run's prefix, log-probs too; a second
    limit compiles nothing."""
    from jspec.decode import _generate

    model = tiny_model()
    ids, lens = jspec.bucket_prompts(PROMPTS)
    assert ids.shape == (3, 32) and list(lens) == [8, 3, 6]
    kw = {} if spec is None else dict(drafter=jspec.load_drafter(spec, target=model),
                                      length=jspec.FixedLength(3))
    full = jspec.generate(model, ids, lens, max_new_tokens=12, **kw)
    n_full = np.asarray(full.lengths)
    cut = jspec.generate(model, ids, lens, max_new_tokens=12, limit=np.asarray([3, 12, 1]),
                         **kw)
    size = _generate._cache_size()
    again = jspec.generate(model, ids, lens, max_new_tokens=12, limit=5, **kw)
    assert _generate._cache_size() == size
    for out, lim in ((cut, [3, 12, 1]), (again, [5, 5, 5])):
        n = np.asarray(out.lengths)
        np.testing.assert_array_equal(n, np.minimum(n_full, lim))
        for r in range(3):
            np.testing.assert_array_equal(np.asarray(out.tokens)[r, :n[r]],
                                          np.asarray(full.tokens)[r, :n[r]])
            assert np.all(np.asarray(out.tokens)[r, n[r]:] == -1)
            np.testing.assert_allclose(np.asarray(out.logprobs)[r, :n[r]],
                                       np.asarray(full.logprobs)[r, :n[r]], rtol=1e-6,
                                       atol=1e-6)
    with pytest.raises(jspec.JspecError, match="one value per row"):
        jspec.generate(model, ids, lens, max_new_tokens=4, limit=np.asarray([1, 2]))


@pytest.mark.parametrize("spec", [None, "early-exit:1"])
def test_stop_ids_are_dynamic(spec):
    """`stop_ids=` (an i32[S] array) replaces the model's EOS ids: each row ends at its first
    stop id; other ids of the same S compile nothing."""
    from jspec.decode import _generate

    model = tiny_model()
    ids, lens = jspec.bucket_prompts(PROMPTS)
    kw = {} if spec is None else dict(drafter=jspec.load_drafter(spec, target=model),
                                      length=jspec.FixedLength(3))
    free = jspec.generate(model, ids, lens, max_new_tokens=12, stop_ids=[-1, -1], **kw)
    size = _generate._cache_size()
    toks = np.asarray(free.tokens)
    assert np.all(np.asarray(free.lengths) == 12)
    stop = int(toks[0, 3])
    out = jspec.generate(model, ids, lens, max_new_tokens=12, stop_ids=[stop, -1], **kw)
    assert _generate._cache_size() == size
    for r in range(3):
        hits = np.flatnonzero(toks[r] == stop)
        n = int(hits[0]) + 1 if hits.size else 12
        assert int(out.lengths[r]) == n
        np.testing.assert_array_equal(np.asarray(out.tokens)[r, :n], toks[r, :n])
    with pytest.raises(jspec.JspecError, match="stop_ids"):
        jspec.generate(model, ids, lens, max_new_tokens=4, stop_ids=[])
