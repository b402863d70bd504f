"""jspec.sampling: the two-reduction argmax and the Gumbel-max draw built on it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.sampling import argmax, categorical


def _cases() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 3, 1000)).astype(np.float32)
    ties = np.round(rng.normal(size=(64, 50)), 0).astype(np.float32)  # many equal maxima
    flat = np.zeros((4, 33), np.float32)  # every entry the maximum
    special = np.array([[1.0, np.nan, 3.0, np.nan],      # NaN: jnp.argmax answers its index
                        [-np.inf, -np.inf, -np.inf, -np.inf],
                        [np.inf, 1.0, np.inf, 0.0],
                        [-1e30, -1e30, -2e30, -1e30]], np.float32)
    return [x, ties, flat, special]


@pytest.mark.parametrize("i", range(4))
def test_argmax_is_jnp_argmax(i):
    x = jnp.asarray(_cases()[i])
    got = jax.jit(argmax)(x)
    assert got.dtype == jnp.int32 and got.shape == x.shape[:-1]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))


def test_argmax_differs_from_last_maximum():
    # The broken variant (the last maximum) answers differently on ties: the check above can fail.
    x = jnp.asarray(_cases()[1])
    last = x.shape[-1] - 1 - jnp.argmax(x[..., ::-1], axis=-1)
    assert np.any(np.asarray(last) != np.asarray(argmax(x)))


def test_categorical_draws_what_jax_random_categorical_draws():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 4, 512)).astype(np.float32))
    for seed in range(5):
        key = jax.random.key(seed)
        np.testing.assert_array_equal(np.asarray(jax.jit(categorical)(key, x)),
                                      np.asarray(jax.random.categorical(key, x, axis=-1)))
    # and depends on the key (not a constant answer)
    a, b = categorical(jax.random.key(0), x), categorical(jax.random.key(1), x)
    assert np.any(np.asarray(a) != np.asarray(b))
