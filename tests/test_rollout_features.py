"""generate(features=...) (issue 58 item 6): the rollout as a drafter's training batch, the
target's feature-layer and final hidden states of the committed tokens read from the passes
that already ran, equal to a teacher-forced forward over the sequence
(tests/test_train_step.py trains a drafter on it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import pad_prompts, tiny_model
from test_rl import PROMPTS, TOP_P, _build

import jspec
from jspec.models import KVCache, forward
from jspec.models.blocks import rms_normalize


def teacher_forced(model, seq: np.ndarray, layers: tuple[int, ...]):
    """(f32[B, W, F, D] RMS-normalised hidden states of `layers`, f32[B, W, D] final-normed
    hidden states) of one causal forward over seq i32[B, W]."""
    b, w = seq.shape
    pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    out = forward(model.config, model.weights, jnp.asarray(seq), pos,
                  KVCache.create(model.config, b, w), hidden_layers=layers)
    return (np.asarray(jnp.moveaxis(rms_normalize(out.hidden), 0, 2)),
            np.asarray(out.final_hidden, np.float32))


def check_rollout(model, out, ids, lens, layers):
    """sequence = prompt + tokens; features / final_hidden equal the teacher-forced ones at
    every fed position (prompt and new tokens but the row's last) and are 0 elsewhere."""
    seq, f, fin = (np.asarray(x) for x in (out.sequence, out.features, out.final_hidden))
    n, tokens = np.asarray(out.lengths), np.asarray(out.tokens)
    assert f.shape == (*seq.shape, len(layers), model.config.hidden_size)
    want_f, want_fin = teacher_forced(model, seq, layers)
    for r in range(seq.shape[0]):
        end = lens[r] + n[r]
        np.testing.assert_array_equal(seq[r, :lens[r]], ids[r, :lens[r]])
        np.testing.assert_array_equal(seq[r, lens[r]:end], tokens[r, :n[r]])
        fed = end - 1  # the last token is never fed to the target
        np.testing.assert_allclose(f[r, :fed], want_f[r, :fed], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(fin[r, :fed], want_fin[r, :fed], rtol=1e-5, atol=1e-5)
        assert not f[r, fed:].any() and not fin[r, fed:].any()


CASES = [
    pytest.param(None, (0, 1), id="plain"),
    pytest.param("early-exit", (1,), id="chain"),
    pytest.param("early-exit+topk", (0,), id="tree", marks=pytest.mark.slow),
    pytest.param("eagle3", True, id="eagle3"),
]


@pytest.mark.parametrize("kind,features", CASES)
def test_features_equal_a_teacher_forced_forward(kind, features):
    """Sampled decoding (T = 0.8, top-p): plain, a speculative chain, a tree, and EAGLE-3 (its
    own feature layers, features=True); the rows end at different lengths."""
    model = tiny_model()
    ids, lens = pad_prompts(PROMPTS)
    kw = {} if kind is None else dict(drafter=_build(kind, model.weights, model.name),
                                      length=jspec.FixedLength(3))
    out = jspec.generate(model, ids, lens, max_new_tokens=10, sampling=TOP_P,
                         key=jax.random.key(5), limit=jnp.asarray([10, 7, 4]),
                         features=features, **kw)
    if kind is not None and kind != "eagle3":  # (a random EAGLE-3 head accepts nothing)
        assert int(np.asarray(out.stats.accepted).sum()) > 0
    layers = kw["drafter"].caps.feature_layers if features is True else features
    check_rollout(model, out, ids, lens, layers)
    off = jspec.generate(model, ids, lens, max_new_tokens=10, sampling=TOP_P,
                         key=jax.random.key(5), limit=jnp.asarray([10, 7, 4]), **kw)
    np.testing.assert_array_equal(np.asarray(off.tokens), np.asarray(out.tokens))
    assert off.features is None and off.sequence is None


def test_features_errors_name_the_fix():
    model = tiny_model()
    ids, lens = pad_prompts(PROMPTS)
    with pytest.raises(jspec.JspecError, match=r"features=\(layer"):
        jspec.generate(model, ids, lens, max_new_tokens=4, features=True)
    with pytest.raises(jspec.JspecError, match="layer indices"):
        jspec.generate(model, ids, lens, max_new_tokens=4, features=(99,))
    d = _build("eagle3", model.weights, model.name)
    with pytest.raises(jspec.JspecError, match="features=True"):
        jspec.generate(model, ids, lens, max_new_tokens=4, drafter=d, features=(0,))

