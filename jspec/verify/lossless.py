"""Chain verification: exact greedy and lossless speculative sampling with the real q."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.sampling import Sampling, process_logits, sample_from_probs

# Below this residual mass the residual is numerically empty: sample from p instead.
RESIDUAL_EPS = 1e-8


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Lossless:
    """The default verifier: output distributed exactly as the target's (greedy: identical)."""

    def check(self, sampling: Sampling) -> None:
        """Any sampling configuration is fine."""

    def init_state(self, batch: int, max_rounds: int) -> None:
        return None

    def verify(self, vstate: None, key: jax.Array, draft: jax.Array, q: jax.Array | None,
               target_logits: jax.Array, sampling: Sampling, valid: jax.Array
               ) -> tuple[jax.Array, jax.Array, None]:
        n, nxt = verify_chain(key, draft, q, target_logits, sampling, valid)
        return n, nxt, vstate


def leading_true(mask: jax.Array) -> jax.Array:
    """i32[B]: length of the all-True prefix of bool[B, K]."""
    return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def verify_chain(key: jax.Array, draft: jax.Array, q: jax.Array | None, target_logits: jax.Array,
                 sampling: Sampling, valid: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
    """Decide how many drafted tokens to accept and the token that follows them.

    Args:
      key: PRNG key (unused when greedy).
      draft: i32[B, K] drafted tokens.
      q: f32[B, K, V] draft distributions after the same processing as p, or None for a
        deterministic (one-hot) draft.
      target_logits: f32[B, K+1, V] raw target logits at the K drafted positions + 1.
      sampling: applied identically to p (and, by the drafter, to q).
      valid: bool[B, K] or None; an invalid position is a slot where the drafter proposed
        nothing: it is rejected, and the token there is drawn from p itself (q counts as 0).
    Returns:
      (n_accepted i32[B] in [0, K], next_token i32[B]): correction or bonus token.
    """
    b, k = draft.shape
    z = process_logits(target_logits, sampling)  # [B, K+1, V]
    ok = jnp.ones((b, k), bool) if valid is None else valid
    if sampling.greedy:
        target_tok = jnp.argmax(z, axis=-1).astype(jnp.int32)  # [B, K+1]
        n = leading_true(ok & (draft == target_tok[:, :k]))
        return n, jnp.take_along_axis(target_tok, n[:, None], axis=1)[:, 0]
    p = jax.nn.softmax(z, axis=-1)  # [B, K+1, V]
    k_u, k_s = jax.random.split(key)
    p_x = jnp.take_along_axis(p[:, :k], draft[..., None], axis=-1)[..., 0]  # [B, K]
    if q is None:
        q = jax.nn.one_hot(draft, p.shape[-1], dtype=jnp.float32)
    q_x = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(k_u, (b, k))
    # u < p/q without dividing: q_x > 0 for any token the drafter could have sampled.
    n = leading_true(ok & (u * q_x < p_x))
    rows = jnp.arange(b)
    p_n = p[rows, n]  # [B, V]
    proposed = (n < k) & ok[rows, jnp.minimum(n, k - 1)]
    q_n = jnp.where(proposed[:, None], q[rows, jnp.minimum(n, k - 1)], 0.0)
    resid = jnp.maximum(p_n - q_n, 0.0)
    mass = jnp.sum(resid, axis=-1, keepdims=True)
    dist = jnp.where(mass > RESIDUAL_EPS, resid, p_n)
    return n, sample_from_probs(k_s, dist)
