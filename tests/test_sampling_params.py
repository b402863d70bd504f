"""Temperature / top-k / top-p as traced per-row values (issue 58 item 4): `SamplingParams`
beside the static `Sampling`. Each row is processed exactly as the static sampling with its
values would process it; generate gives the same tokens row by row; new values compile
nothing; exact at every temperature by enumeration; errors name the fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import pad_prompts, tiny_model
from test_rl import teacher_forced_logprobs

import jspec
from jspec.sampling import NEG, Sampling, SamplingParams, process_logits

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11], [20, 21, 22, 23, 20, 21]]
# One (temperature, top_k, top_p) per row; the static program: sampled, top-k bound 8.
ROWS = [(0.7, 0, 1.0), (1.3, 5, 0.9), (0.4, 8, 0.6)]
PROGRAM = Sampling(temperature=1.0, top_k=8)


def params_of(rows) -> SamplingParams:
    t, k, p = zip(*rows, strict=True)
    return SamplingParams(temperature=jnp.asarray(t, jnp.float32),
                          top_k=jnp.asarray(k, jnp.int32), top_p=jnp.asarray(p, jnp.float32))


def test_each_row_is_processed_as_its_static_sampling():
    """process_logits with per-row values equals, row by row and bit for bit, the static
    Sampling of that row's values (eager and jitted); temperature 0 (and a subnormal one) is
    that row's argmax, one-hot; a top_k of 0 keeps all, top_p 1 keeps all."""
    rows = [*ROWS, (0.0, 3, 0.5), (1e-39, 0, 1.0), (2.0, 8, 0.3)]
    logits = jax.random.normal(jax.random.key(0), (len(rows), 3, 50)) * 4
    params = params_of(rows)
    eager = process_logits(logits, PROGRAM.with_rows(params))
    jitted = jax.jit(lambda x, p: process_logits(x, PROGRAM.with_rows(p)))(logits, params)
    for r, (t, k, p) in enumerate(rows):
        if t == 0:
            hot = jnp.arange(50) == jnp.argmax(logits[r], axis=-1)[:, None]
            want = jnp.where(hot, 0.0, NEG)
        else:
            want = process_logits(logits[r], Sampling(temperature=t, top_k=k, top_p=p))
        np.testing.assert_array_equal(np.asarray(eager[r]), np.asarray(want), err_msg=str(r))
        np.testing.assert_array_equal(np.asarray(jitted[r]), np.asarray(want), err_msg=str(r))


CASES = [
    pytest.param(None, id="plain"),
    pytest.param("early-exit:1", id="chain"),
    pytest.param("early-exit:1+topk:k=2,nodes=4", id="tree", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("spec", CASES)
def test_generate_rows_equal_static_runs(spec):
    """One traced run with a value set per row gives, in each row, the tokens (and log-probs)
    of the static run with that row's values (same key: the noise of a row does not depend on
    the other rows' values). So the law of each row is the static one, which the distribution
    tests check."""
    model = tiny_model()
    ids, lens = pad_prompts(PROMPTS)
    kw = {} if spec is None else dict(drafter=jspec.load_drafter(spec, target=model),
                                      length=jspec.FixedLength(3))
    run = dict(max_new_tokens=10, key=jax.random.key(7), **kw)
    traced = jspec.generate(model, ids, lens, sampling=PROGRAM, sampling_params=params_of(ROWS),
                            **run)
    for r, (t, k, p) in enumerate(ROWS):
        ref = jspec.generate(model, ids, lens, sampling=Sampling(t, k, p), **run)
        np.testing.assert_array_equal(np.asarray(traced.tokens[r]), np.asarray(ref.tokens[r]))
        np.testing.assert_allclose(np.asarray(traced.logprobs[r]), np.asarray(ref.logprobs[r]),
                                   rtol=1e-6, atol=1e-6)


def test_logprobs_equal_a_teacher_forced_recomputation():
    """Per-row values: log-probs equal log p under each row's processed distribution from a
    teacher-forced forward (speculative chain)."""
    model = tiny_model()
    ids, lens = pad_prompts(PROMPTS)
    params = params_of(ROWS)
    out = jspec.generate(model, ids, lens, max_new_tokens=12, sampling=PROGRAM,
                         sampling_params=params, key=jax.random.key(4),
                         drafter=jspec.load_drafter("early-exit:1", target=model),
                         length=jspec.FixedLength(3))
    tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
    assert int(np.asarray(out.stats.accepted).sum()) > 0
    want = teacher_forced_logprobs(model, ids, lens, tokens, n, PROGRAM.with_rows(params))
    np.testing.assert_allclose(np.asarray(out.logprobs), want, rtol=1e-5, atol=1e-5)


def test_new_values_compile_nothing():
    """A second call with other values (scalars broadcast, or per row) compiles nothing, in
    generate's own jit and inside a user's jit; the output changes with the values."""
    from jspec.decode import _generate

    model = tiny_model()
    ids, lens = pad_prompts(PROMPTS)
    d = jspec.load_drafter("early-exit:1", target=model)
    kw = dict(max_new_tokens=8, sampling=PROGRAM, drafter=d, length=jspec.FixedLength(3),
              key=jax.random.key(1))
    a = jspec.generate(model, ids, lens, sampling_params=params_of(ROWS), **kw)
    before = _generate._cache_size()
    b = jspec.generate(model, ids, lens, sampling_params=SamplingParams(
        temperature=3.0, top_k=1, top_p=0.5), **kw)
    assert _generate._cache_size() == before
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))

    @jax.jit
    def step(t, key):
        return jspec.generate(model, ids, lens, max_new_tokens=8, sampling=PROGRAM,
                              sampling_params=SamplingParams(temperature=t), key=key).tokens

    step(jnp.float32(0.5), jax.random.key(2))  # the user's jit traces a scalar and a [B]
    step(jnp.full((3,), 2.0, jnp.float32), jax.random.key(2))  # argument apart
    assert step._cache_size() == 2
    step(jnp.float32(1.5), jax.random.key(3))
    step(jnp.full((3,), 0.9, jnp.float32), jax.random.key(3))
    assert step._cache_size() == 2


def test_chain_exact_with_a_traced_temperature(monkeypatch):
    """The enumerated law of a chain round (tests/exact_law.py) with the temperature a traced
    value of one compiled verifier: exact at T = 0.05..1 (TV <= 1e-5), one compile."""
    import exact_law
    from test_exact_law import CASES as LAW_CASES
    from test_exact_law import TOL, V, tables

    from jspec.verify.lossless import decide_chain

    traced = jax.jit(lambda u, dr, q, a, valid, t: decide_chain(
        u, dr, q, a, PROGRAM.with_rows(SamplingParams(temperature=t)), valid))
    monkeypatch.setattr(exact_law, "_decide_chain", lambda u, dr, q, a, s, valid: traced(
        u, dr, q, a, valid, jnp.float32(s.temperature)))
    for t, kind, seed in LAW_CASES[::3]:
        a, d = tables(seed, t, kind)
        tv, total = exact_law.chain_law(a, d, seed % V, 3, t)
        assert abs(total - 1.0) < 1e-6 and tv <= TOL, (t, kind, seed, tv, total)
    assert traced._cache_size() == 1


def test_errors_name_the_fix():
    model = tiny_model()
    ids, lens = pad_prompts(PROMPTS)
    key = jax.random.key(0)
    with pytest.raises(jspec.JspecError, match=r"Sampling\(temperature=1.0\)"):
        jspec.generate(model, ids, lens, max_new_tokens=4, key=key,
                       sampling_params=SamplingParams(temperature=0.5))
    with pytest.raises(jspec.JspecError, match=r"Sampling\(top_k=K\)"):
        jspec.generate(model, ids, lens, max_new_tokens=4, key=key,
                       sampling=Sampling(temperature=1.0),
                       sampling_params=SamplingParams(top_k=3))
    with pytest.raises(jspec.JspecError, match="one value per row"):
        jspec.generate(model, ids, lens, max_new_tokens=4, key=key, sampling=PROGRAM,
                       sampling_params=SamplingParams(temperature=jnp.ones((2,))))
    with pytest.raises(jspec.JspecError, match="sampling_params="):
        jspec.generate(model, ids, lens, max_new_tokens=4, key=key,
                       sampling=PROGRAM.with_rows(SamplingParams(temperature=jnp.ones(3))))
    with pytest.raises(TypeError, match="not static"):
        hash(PROGRAM.with_rows(SamplingParams(temperature=jnp.ones(3))))
