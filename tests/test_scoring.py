"""`jspec.logprobs` (issue 58): teacher-forced log-probs of completions equal the ones
`generate` reported while sampling them (plain and speculative, chains and trees, top-k/top-p,
per-row sampling values), are differentiable, and compile once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import pad_prompts, tiny_model
from test_rl import GREEDY, PROMPTS, TOP_K, TOP_P

import jspec


@pytest.mark.parametrize("spec,sampling", [
    (None, TOP_K), ("early-exit:1", TOP_P), ("early-exit:1+topk:k=2,nodes=4", GREEDY)])
def test_logprobs_equal_generates(spec, sampling):
    model = tiny_model()
    ids, lens = pad_prompts(PROMPTS)
    kw = {} if spec is None else dict(drafter=jspec.load_drafter(spec, target=model),
                                      length=jspec.FixedLength(3))
    out = jspec.generate(model, ids, lens, max_new_tokens=12, sampling=sampling,
                         key=jax.random.key(4), **kw)
    got = jspec.logprobs(model, jnp.asarray(ids), jnp.asarray(lens), out.tokens,
                         sampling=sampling)
    np.testing.assert_allclose(np.asarray(got), np.asarray(out.logprobs), rtol=1e-5, atol=1e-5)
    # rows cut after 2, 5 and 12 tokens (-1 after, as generate ends a row): the same log-probs
    # before the cut, 0 from it on
    n = np.asarray([2, 5, 12])
    cut = jnp.where(jnp.arange(12)[None] < n[:, None], out.tokens, -1)
    raw = np.asarray(jspec.logprobs(model, jnp.asarray(ids), jnp.asarray(lens), cut,
                                    sampling=sampling, processed=False))
    short = np.asarray(jspec.logprobs(model, jnp.asarray(ids), jnp.asarray(lens), cut,
                                      sampling=sampling))
    for r in range(len(PROMPTS)):
        assert np.all(raw[r, n[r]:] == 0.0) and np.all(short[r, n[r]:] == 0.0)
        np.testing.assert_allclose(short[r, :n[r]], np.asarray(got)[r, :n[r]], rtol=1e-6)
    if not sampling.greedy:  # the processed distribution differs from the raw softmax
        assert np.abs(raw - np.asarray(got)).max() > 1e-3


def test_per_row_sampling_values_and_a_gradient_with_one_compile():
    model = tiny_model()
    ids, lens = pad_prompts(PROMPTS)
    params = jspec.SamplingParams(temperature=jnp.asarray([0.7, 1.0, 1.3]),
                                  top_k=jnp.asarray([0, 4, 8], jnp.int32),
                                  top_p=jnp.asarray([0.9, 1.0, 0.8]))
    s = jspec.Sampling(temperature=1.0, top_k=8, top_p=0.9)
    out = jspec.generate(model, ids, lens, max_new_tokens=8, sampling=s, key=jax.random.key(1),
                         sampling_params=params)
    ids_, lens_ = jnp.asarray(ids), jnp.asarray(lens)

    @jax.jit
    def loss(weights, tokens):
        m = jspec.Model(config=model.config, weights=weights)
        return jspec.logprobs(m, ids_, lens_, tokens, sampling=s.with_rows(params)).sum()

    want = float(np.asarray(out.logprobs).sum())
    assert float(loss(model.weights, out.tokens)) == pytest.approx(want, rel=1e-5, abs=1e-4)
    g = jax.grad(loss)(model.weights, out.tokens)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(g))
    assert float(jnp.abs(g.final_norm).sum()) > 0
    loss(model.weights, jnp.where(out.tokens >= 0, (out.tokens + 1) % 50, -1))
    assert loss._cache_size() == 1
