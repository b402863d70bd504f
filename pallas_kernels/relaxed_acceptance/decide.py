"""The O(B·K) acceptance decisions and constants shared by the reference and both kernels.

Both compute per-position statistics over the vocabulary their own way (full arrays / merged
partials); from those the verdict is the same few jnp ops, kept here once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A large finite negative instead of -inf (no inf - inf = NaN in the running max updates).
MASK_VALUE = -1e30
# Below this residual mass the residual is numerically empty: sample from p instead. Its mass
# is the probability of the rejection that leads there, so this costs at most RESIDUAL_EPS in
# total variation. The one definition: `jspec.verify` (chains, drawn trees) and every kernel
# read it from here.
RESIDUAL_EPS = 1e-8
BIG_INDEX = 2**30  # larger than any vocabulary index
# The smallest sampling temperature the kernels take. They divide raw logits by it tile by
# tile (no row max is known before the last tile), so a tiny temperature overflows z / T to
# ±inf (NaN in the running max) or pushes it below MASK_VALUE: above 1e-6, logits up to 1e24
# in magnitude stay finite and above MASK_VALUE. Below it, `jspec.verify` uses the jnp path
# (`jspec.sampling.process_logits` subtracts the row max first, exact for any T > 0).
MIN_TEMPERATURE = 1e-6


def decide_greedy(x: jax.Array,  # i32[B, K] drafted tokens
                  valid: jax.Array,  # bool[B, K]
                  target_tok: jax.Array,  # i32[B, K+1] first argmax of each target row
                  choice: jax.Array,  # i32[B, K] the verifier's pick (argmax p, or argmax ν)
                  weighted: bool,
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:  # n i32[B], tok i32[B], prob f32[B, K]
    """Greedy: accept x_i iff it is the verifier's pick; next token at the first rejection."""
    b, k = x.shape
    rows = jnp.arange(b)
    accept = valid & (x == choice)
    n = jnp.min(jnp.where(accept, k, jnp.arange(k)[None, :]), axis=1).astype(jnp.int32)
    row = jnp.minimum(n, k - 1)
    proposed = (n < k) & valid[rows, row]
    tok = target_tok[rows, n]
    if weighted:
        tok = jnp.where(proposed, choice[rows, row], tok)
    return n, tok.astype(jnp.int32), accept.astype(jnp.float32)


def decide_sampled(x: jax.Array,  # i32[B, K]
                   valid: jax.Array,  # bool[B, K]
                   zx: jax.Array,  # f32[B, K] tempered target logit of each drafted token
                   qx: jax.Array,  # f32[B, K] its draft probability
                   lse: jax.Array,  # f32[B, K] log-normaliser of each drafted position's p
                   u: jax.Array,  # f32[B, K] uniforms
                   wv: jax.Array,  # f32[B] weight on the target
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Sampling: (n i32[B], row = min(n, K-1) i32[B], proposed bool[B], prob f32[B, K]).

    Accept x_i iff u_i·q(x_i) < ν(x_i), ν = w·p + (1-w)·q; `proposed`: position n < K held a
    draft (the residual then subtracts q_n).
    """
    wc = wv[:, None]
    return accept_sampled(valid, u, qx, wc * jnp.exp(zx - lse) + (1.0 - wc) * qx)


def accept_sampled(valid: jax.Array,  # bool[B, K]
                   u: jax.Array,  # f32[B, K] uniforms
                   qx: jax.Array,  # f32[B, K] draft probability of each drafted token
                   nu_x: jax.Array,  # f32[B, K] the verifier's probability of it (lossless: p)
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The acceptance core of every sampled verification (jspec's jnp path for chains and
    drawn trees, the reference and the kernels): accept x_i iff u_i·q(x_i) < ν(x_i) (u < ν/q
    without dividing, so no q can make it divide by zero), up to the first rejection. Callers
    pass q(x_i) = 1 where the draft's q gives x_i no mass (a deterministic slot, or a tail draw
    whose q underflowed float32: verified one-hot, `jspec.sampling.one_hot_where_deterministic`);
    q(x_i) = 0 here would accept whenever ν(x_i) > 0. Returns (n i32[B], row = min(n, K-1)
    i32[B], proposed bool[B]: position n held a draft, prob f32[B, K] = min(1, ν/q) per valid
    position; 1 where q = 0)."""
    b, k = valid.shape
    accept = valid & (u * qx < nu_x)
    prob = jnp.where(valid, jnp.where(qx > 0, jnp.minimum(1.0, nu_x / jnp.where(qx > 0, qx, 1.0)),
                                      1.0), 0.0)
    n = jnp.min(jnp.where(accept, k, jnp.arange(k)[None, :]), axis=1).astype(jnp.int32)
    row = jnp.minimum(n, k - 1)
    proposed = (n < k) & valid[jnp.arange(b), row]
    return n, row, proposed, prob
