"""The same-signature jnp reference of `relaxed_acceptance` (full [B, K+1, V] arrays): the
kernels' tests compare against it, and it shares the per-row decisions (`decide.py`) with them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.relaxed_acceptance.decide import decide_greedy, decide_sampled
from pallas_kernels.relaxed_acceptance.kernel import (
    MASK_VALUE,
    RESIDUAL_EPS,
    Acceptance,
    _check_inputs,
    _common,
)


@functools.partial(jax.jit, static_argnames=("temperature", "block_v", "block_b", "interpret"))
def relaxed_acceptance_reference(
    target_logits: jax.Array,  # f32|bf16[B, K+1, V] raw target logits
    draft: jax.Array,  # i32[B, K]
    q: jax.Array | None,  # f32[B, K, V] | None (one-hot draft)
    valid: jax.Array | None = None,  # bool[B, K] | None
    w: jax.Array | float | None = None,  # f32 scalar | f32[B] | None (= 1)
    uniforms: jax.Array | None = None,  # f32[B, K]
    gumbel: jax.Array | None = None,  # f32[B, V]
    *,
    temperature: float,
    block_v: int | None = None,
    block_b: int | None = None,
    interpret: bool | None = None,
) -> Acceptance:
    """Pure-jnp `relaxed_acceptance`: same signature and result, full [B, K+1, V] arrays.

    `block_v`, `block_b` and `interpret` are accepted (and ignored) so the two are
    interchangeable.
    """
    del block_v, block_b, interpret
    _check_inputs(target_logits, draft, q, valid, w, uniforms, gumbel, temperature)
    b, k1, v = target_logits.shape
    k = k1 - 1
    x, ok, u, wv = _common(draft, valid, w, uniforms, b, k)
    ok = ok > 0
    wc = wv[:, None]  # [B, 1]
    z = target_logits.astype(jnp.float32)
    if temperature > 0:
        z = z / temperature
    qf = jax.nn.one_hot(x, v, dtype=jnp.float32) if q is None else q.astype(jnp.float32)
    lse = jax.nn.logsumexp(z, axis=-1)  # [B, K+1]
    rows = jnp.arange(b)
    if temperature == 0:
        target_tok = jnp.argmax(z, axis=-1).astype(jnp.int32)  # [B, K+1]
        if w is None:
            choice = target_tok[:, :k]
        else:
            nu = wc[..., None] * jnp.exp(z[:, :k] - lse[:, :k, None]) \
                + (1.0 - wc[..., None]) * qf * ok[..., None]
            choice = jnp.argmax(nu, axis=-1).astype(jnp.int32)
        return Acceptance(*decide_greedy(x, ok, target_tok, choice, w is not None))
    zx = jnp.take_along_axis(z[:, :k], x[..., None], axis=-1)[..., 0]  # [B, K]
    qx = jnp.take_along_axis(qf, x[..., None], axis=-1)[..., 0]
    n, row, proposed, prob = decide_sampled(x, ok, zx, qx, lse[:, :k], u, wv)
    logp = z[rows, n] - lse[rows, n][:, None]  # [B, V]
    q_n = jnp.where(proposed[:, None], qf[rows, row], 0.0)
    r = jnp.maximum(jnp.exp(logp) - q_n, 0.0)
    mass = jnp.sum(r, axis=-1)
    g = gumbel.astype(jnp.float32)
    key_r = jnp.where(r > 0, jnp.log(jnp.where(r > 0, r, 1.0)) + g, MASK_VALUE)
    tok = jnp.where(mass > RESIDUAL_EPS, jnp.argmax(key_r, axis=-1), jnp.argmax(logp + g, axis=-1))
    return Acceptance(n, tok.astype(jnp.int32), prob)
