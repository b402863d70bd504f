"""Inputs that used to give silent wrong answers: left-padded batches, ragged batches without
lengths, HF attention masks, and tiny temperatures."""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import pad_prompts, tiny_model

import jspec
from jspec.decode import stream
from jspec.inputs import left_to_right_padded, validate_prompts
from jspec.sampling import process_logits, sample
from jspec.verify import Lossless, verify_chain
from pallas_kernels.relaxed_acceptance import (
    MIN_TEMPERATURE,
    relaxed_acceptance,
    relaxed_acceptance_reference,
)

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20], [30, 31, 32, 33, 34]]


@functools.cache
def padded_model() -> jspec.Model:
    """The tiny model with a tokenizer that declares pad id = its EOS (1), as SmolLM2's does."""
    model = tiny_model("llama_untied_mha", seed=3)
    return dataclasses.replace(model, tokenizer=types.SimpleNamespace(pad_token_id=1))


def left_pad(prompts: list[list[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded i32[B, P] ids and the HF attention mask i32[B, P]."""
    width = max(map(len, prompts))
    ids = np.full((len(prompts), width), pad, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    return ids, mask


def test_model_pad_id():
    assert tiny_model().pad_id is None
    assert padded_model().pad_id == 1


def test_left_padded_batch_equals_right_padded():
    """padding_side="left" with lengths or a mask gives the right-padded batch's tokens."""
    model = padded_model()
    right, lengths = pad_prompts(PROMPTS)
    right = np.where(np.arange(right.shape[1])[None] < lengths[:, None], right, 1)  # pad-filled
    want = jspec.generate(model, right, lengths, max_new_tokens=8)
    left, mask = left_pad(PROMPTS, pad=1)
    by_len = jspec.generate(model, left, lengths, padding_side="left", max_new_tokens=8)
    by_mask = jspec.generate(model, left, attention_mask=mask, padding_side="left",
                             max_new_tokens=8)
    right_mask = (np.arange(right.shape[1])[None] < lengths[:, None]).astype(bool)
    by_right_mask = jspec.generate(model, right, attention_mask=right_mask, max_new_tokens=8)
    for out in (by_len, by_mask, by_right_mask):
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))
        np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(want.lengths))
    streamed = list(stream(model, left, attention_mask=mask, padding_side="left",
                           max_new_tokens=8))[-1][0]
    np.testing.assert_array_equal(streamed, np.asarray(want.tokens))


def test_left_padding_under_jit():
    """Traced ids and mask: the conversion to right padding runs inside the user's jit."""
    model = padded_model()
    left, mask = left_pad(PROMPTS, pad=1)
    right, lengths = pad_prompts(PROMPTS)
    want = jspec.generate(model, right, lengths, max_new_tokens=6).tokens

    @jax.jit
    def run(m, ids, mask):
        return jspec.generate(m, ids, attention_mask=mask, padding_side="left",
                              max_new_tokens=6).tokens

    np.testing.assert_array_equal(np.asarray(run(model, left, mask)), np.asarray(want))


def test_left_to_right_padded_is_a_per_row_roll():
    ids = jnp.asarray([[0, 0, 5, 6], [7, 8, 9, 4], [0, 0, 0, 3]], jnp.int32)
    out = jax.jit(left_to_right_padded)(ids, jnp.asarray([2, 4, 1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), [[5, 6, 0, 0], [7, 8, 9, 4], [3, 0, 0, 0]])


def test_left_padded_batch_read_as_right_padded_is_refused():
    """The HF mistake: left-padded ids with lengths (or a left mask) and the default side."""
    model = padded_model()
    left, mask = left_pad(PROMPTS, pad=1)
    lengths = mask.sum(-1)
    with pytest.raises(jspec.JspecError, match="padding_side='left'"):
        jspec.generate(model, left, lengths, max_new_tokens=4)
    with pytest.raises(jspec.JspecError, match="padding_side='left'"):
        jspec.generate(model, left, attention_mask=mask, max_new_tokens=4)
    # And the reverse: a right-padded batch declared left.
    right = np.fliplr(left).copy()
    for i, p in enumerate(PROMPTS):
        right[i, :len(p)] = p
    with pytest.raises(jspec.JspecError, match="padding_side='right'"):
        jspec.generate(model, right, lengths, padding_side="left", max_new_tokens=4)
    # A right-padded row whose prompt starts with pad tokens, padded with pad tokens, passes.
    jspec.generate(model, np.asarray([[1, 5, 6, 1], [7, 8, 9, 10]], np.int32),
                   np.asarray([3, 4]), max_new_tokens=2)
    # Pad = BOS: a right-padded prompt starts with one (passes); left padding adds more.
    bos = dataclasses.replace(model, config=model.config.replace(bos_id=1))
    lengths = np.asarray([3, 4])
    validate_prompts(bos, np.asarray([[1, 5, 6, 0], [1, 7, 8, 9]], np.int32), lengths, 2, None)
    with pytest.raises(jspec.JspecError, match="padding_side='left'"):
        validate_prompts(bos, np.asarray([[1, 1, 5, 6], [1, 7, 8, 9]], np.int32), lengths, 2,
                         None)


@pytest.mark.parametrize("kwargs, match", [
    (dict(padding_side="middle"), "padding_side"),
    (dict(prompt_lengths=np.asarray([2, 1]), attention_mask=np.ones((2, 2))), "not both"),
    (dict(attention_mask=np.ones((2, 3), np.int32)), "shape"),
    (dict(attention_mask=np.ones((2, 2), np.float32)), "integers or booleans"),
    (dict(attention_mask=np.asarray([[1, 2], [1, 1]])), "0s and 1s"),
    (dict(attention_mask=np.asarray([[0, 1], [1, 1]])), "padding_side='left'"),
    (dict(attention_mask=np.asarray([[1, 0], [1, 1]]), padding_side="left"),
     "padding_side='right'"),
    (dict(attention_mask=np.asarray([[1, 0], [0, 0]])), "empty"),
])
def test_bad_padding_arguments(kwargs, match):
    model = tiny_model()
    ids = np.asarray([[5, 6], [7, 8]], np.int32)
    with pytest.raises(jspec.JspecError, match=match):
        jspec.generate(model, ids, max_new_tokens=2, **kwargs)


def test_mask_with_a_hole_is_refused():
    model = tiny_model()
    with pytest.raises(jspec.JspecError, match="one run of 1s"):
        jspec.generate(model, np.asarray([[5, 6, 7]], np.int32),
                       attention_mask=np.asarray([[1, 0, 1]]), max_new_tokens=2)


def test_ragged_batch_without_lengths_is_refused():
    """Without lengths the padding would be read as prompt: refused when rows end (or start)
    in different numbers of pad tokens; uniform batches and single prompts pass as before."""
    model = padded_model()
    right = np.asarray([[5, 6, 7, 1, 1], [8, 9, 10, 11, 1]], np.int32)
    with pytest.raises(jspec.JspecError, match="prompt_lengths"):
        jspec.generate(model, right, max_new_tokens=2)
    left = np.asarray([[1, 1, 5, 6, 7], [1, 8, 9, 10, 11]], np.int32)
    with pytest.raises(jspec.JspecError, match="prompt_lengths"):
        jspec.generate(model, left, padding_side="left", max_new_tokens=2)
    jspec.generate(model, np.asarray([[5, 6, 1], [7, 8, 1]], np.int32), max_new_tokens=2)
    jspec.generate(model, np.asarray([[5, 6, 1, 1]], np.int32), max_new_tokens=2)
    jspec.generate(model, right, np.asarray([3, 4]), max_new_tokens=2)


def test_tiny_temperature_logits_stay_finite():
    logits = jnp.asarray([[1.0, 3.0, -2.0, 2.5], [0.0, -1e30, 4.0, 4.5]])
    # 1e-38 is below float32's normal range; 1e-30 overflows the non-maximal entries.
    for s in (jspec.Sampling(temperature=1e-38), jspec.Sampling(temperature=1e-38, top_k=2),
              jspec.Sampling(temperature=1e-38, top_p=0.5), jspec.Sampling(temperature=1e-30)):
        z = process_logits(logits, s)
        assert np.isfinite(np.asarray(z)).all(), s
        np.testing.assert_array_equal(np.asarray(jax.nn.softmax(z, axis=-1)),
                                      np.eye(4, dtype=np.float32)[[1, 3]])
        keys = jax.random.split(jax.random.key(0), 64)
        toks = jax.vmap(lambda k, s=s: sample(k, logits, s))(keys)
        assert (np.asarray(toks) == [1, 3]).all(), s


def test_non_finite_temperature_is_refused():
    for t in (float("nan"), float("inf")):
        with pytest.raises(jspec.JspecError, match="temperature"):
            jspec.Sampling(temperature=t)


@pytest.mark.parametrize("drafter_name", [None, "ngram", "early-exit:1"])
def test_tiny_temperature_samples_the_greedy_tokens(drafter_name):
    """T = 1e-38 is greedy in all but name: autoregressive and speculative output equals the
    greedy output (it was token 0 over and over: logits / T overflowed to inf and NaN)."""
    model = tiny_model("llama_tied_gqa2", seed=1)
    ids, lengths = pad_prompts([[5, 6, 7, 5, 6, 7, 5, 6], [20, 21]])
    greedy = jspec.generate(model, ids, lengths, max_new_tokens=12)
    assert (np.asarray(greedy.tokens)[:, 0] != 0).all()
    kw = {} if drafter_name is None else dict(
        drafter=jspec.load_drafter(drafter_name, target=model), length=jspec.FixedLength(3))
    tiny = jspec.generate(model, ids, lengths, max_new_tokens=12,
                          sampling=jspec.Sampling(temperature=1e-38), key=jax.random.key(3), **kw)
    np.testing.assert_array_equal(np.asarray(tiny.tokens), np.asarray(greedy.tokens))


def test_fused_acceptance_refuses_tiny_temperature_and_falls_back():
    """The kernel divides raw logits by T tile by tile: below MIN_TEMPERATURE it raises, and
    Lossless(acceptance_impl="pallas") uses the jnp path there (the greedy verdict)."""
    b, k, v = 4, 3, 97
    rng = np.random.default_rng(0)
    z = jnp.asarray(3.0 * rng.standard_normal((b, k + 1, v)), jnp.float32)
    x = jnp.argmax(z[:, :k], axis=-1).astype(jnp.int32).at[0, 1].set(0)  # row 0 rejects at 1
    u = jnp.full((b, k), 0.5)
    g = jnp.zeros((b, v))
    for fn in (relaxed_acceptance, relaxed_acceptance_reference):
        with pytest.raises(ValueError, match="MIN_TEMPERATURE"):
            fn(z, x, None, None, None, u, g, temperature=1e-38)
        fn(z, x, None, None, None, u, g, temperature=MIN_TEMPERATURE)
    tiny = jspec.Sampling(temperature=1e-38)
    key = jax.random.key(0)
    n, nxt, _ = Lossless(acceptance_impl="pallas").verify(None, key, x, None, z, tiny, None)
    gn, gnxt = verify_chain(key, x, None, z, jspec.Sampling())
    np.testing.assert_array_equal(np.asarray(n), np.asarray(gn))
    np.testing.assert_array_equal(np.asarray(nxt), np.asarray(gnxt))
    assert int(n[0]) == 1 and (np.asarray(n[1:]) == k).all()


@pytest.mark.real
def test_real_model_hf_left_padded_batch(real_model):
    """An HF-style left-padded batch (pad = EOS = 2) with its attention mask gives the
    right-padded batch's tokens; with the default side it is refused."""
    enc = [real_model.encode(p) for p in ("What is 2+2?", "Name a fruit.")]
    left, mask = left_pad(enc, pad=real_model.pad_id)
    right, lengths = pad_prompts(enc)
    want = jspec.generate(real_model, right, lengths, max_new_tokens=8)
    got = jspec.generate(real_model, left, attention_mask=mask, padding_side="left",
                         max_new_tokens=8)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    with pytest.raises(jspec.JspecError, match="padding_side='left'"):
        jspec.generate(real_model, left, lengths, max_new_tokens=8)
