"""Chain verification: exact greedy and lossless speculative sampling with the real q."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec import platforms
from jspec.errors import JspecError
from jspec.sampling import (
    Sampling,
    argmax,
    dense_q,
    one_hot_where_deterministic,
    process_logits,
    sample_from_probs,
)
from jspec.verify.base import Supports, Verifier
from jspec.verify.tree import verify_tree
from pallas_kernels.relaxed_acceptance import MIN_TEMPERATURE, relaxed_acceptance
from pallas_kernels.relaxed_acceptance.decide import RESIDUAL_EPS, accept_sampled, decide_greedy

ACCEPTANCE_IMPLS = ("xla", "pallas")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Lossless(Verifier):
    """The default verifier: output distributed exactly as the target's (greedy: identical).

    acceptance_impl: "xla" (`verify_chain`, jnp over full [B, K+1, V] arrays) or "pallas"
      (`verify_chain_fused`: the `pallas_kernels.relaxed_acceptance` kernel, interpret mode on
      CPU, with the same random numbers). The kernel applies temperature only: with top-k or
      top-p, or a temperature below the kernel's MIN_TEMPERATURE (1e-6, where raw logits / T
      would overflow), the verifier uses the xla path (a sort over the vocabulary is not fused).
    """

    acceptance_impl: str = "xla"

    def __post_init__(self) -> None:
        if self.acceptance_impl not in ACCEPTANCE_IMPLS:
            raise JspecError(f"acceptance_impl must be one of {ACCEPTANCE_IMPLS}, "
                             f"got {self.acceptance_impl!r}")

    name = "Lossless"

    @property
    def supports(self) -> Supports:
        """Every temperature, exact; for trees the walk, or recursive rejection sampling for
        children drawn from q (`jspec.verify.tree`); q in the
        drafter's vocabulary (the kernel path scatters it to the target's)."""
        return Supports(trees=True, compact_q=True)

    def verify(self, vstate: None, key: jax.Array, draft: jax.Array, q: jax.Array | None,
               target_logits: jax.Array, sampling: Sampling, valid: jax.Array,
               q_vocab: jax.Array | None = None) -> tuple[jax.Array, jax.Array, None]:
        if self.acceptance_impl == "pallas" and fused_acceptance_supports(sampling):
            q = dense_q(q, q_vocab, target_logits.shape[-1])
            n, nxt = verify_chain_fused(key, draft, q, target_logits, sampling, valid)
        else:
            n, nxt = verify_chain(key, draft, q, target_logits, sampling, valid, q_vocab=q_vocab)
        return n, nxt, vstate

    def verify_tree(self, vstate: None, key: jax.Array, tokens: jax.Array, parents: jax.Array,
                    depth: jax.Array, valid: jax.Array, target_logits: jax.Array,
                    sampling: Sampling, max_depth: int, q: jax.Array | None = None,
                    q_vocab: jax.Array | None = None, max_children: int = 0
                    ) -> tuple[jax.Array, jax.Array, jax.Array, None]:
        n, path, nxt = verify_tree(key, tokens, parents, depth, valid, target_logits, sampling,
                                   max_depth, q=q, q_vocab=q_vocab, max_children=max_children)
        return n, path, nxt, vstate


def fused_acceptance_supports(sampling: Sampling) -> bool:
    """Whether the fused kernel covers this sampling mode: greedy, or temperature only with a
    static temperature (the kernel's is a compile-time constant; per-row traced values take
    the xla path) of at least the kernel's MIN_TEMPERATURE."""

    return (sampling.rows is None and sampling.top_k == 0 and sampling.top_p == 1.0
            and (sampling.greedy or sampling.temperature >= MIN_TEMPERATURE))


def verify_chain_fused(key: jax.Array, draft: jax.Array, q: jax.Array | None,
                       target_logits: jax.Array, sampling: Sampling,
                       valid: jax.Array | None = None, w: jax.Array | float | None = None
                       ) -> tuple[jax.Array, jax.Array]:
    """`verify_chain` through the fused Pallas kernel, with the same random numbers.

    The uniforms and the Gumbel noise are drawn from the same keys `verify_chain` uses
    (`jax.random.categorical` is Gumbel-max), so both return the same tokens up to float
    rounding at exact ties.

    Args:
      key, draft, q, target_logits, sampling, valid: as in `verify_chain` (no top-k/top-p).
      w: DIVERSED weight on the target (f32 scalar or f32[B]); None is lossless.
    Returns:
      (n_accepted i32[B], next_token i32[B]).
    """

    if not fused_acceptance_supports(sampling):
        raise JspecError("the fused acceptance kernel supports temperature only (no top-k/top-p) "
                         f"and temperature 0 or >= {MIN_TEMPERATURE}; got {sampling}")
    b, k = draft.shape
    u = g = None
    if q is not None:  # deterministic slots (no mass at their own token): one-hot rows
        q = one_hot_where_deterministic(q, draft)
    if not sampling.greedy:
        k_u, k_s = jax.random.split(key)
        u = jax.random.uniform(k_u, (b, k))
        g = jax.random.gumbel(k_s, (b, target_logits.shape[-1]), jnp.float32)
    out = relaxed_acceptance(target_logits, draft, q, valid, w, u, g,
                             temperature=float(sampling.temperature), platform=platforms.target())
    return out.n_accepted, out.next_token


def leading_true(mask: jax.Array) -> jax.Array:
    """i32[B]: length of the all-True prefix of bool[B, K]."""
    return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def verify_chain(key: jax.Array, draft: jax.Array, q: jax.Array | None, target_logits: jax.Array,
                 sampling: Sampling, valid: jax.Array | None = None, w: jax.Array | None = None,
                 q_vocab: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Decide how many drafted tokens to accept and the token that follows them.

    Args:
      key: PRNG key (unused when greedy).
      draft: i32[B, K] drafted tokens.
      q: f32[B, K, Vq] draft distributions after the same processing as p over the target
        ids `q_vocab` (i32[Vq]; None: all V), or None for a deterministic (one-hot) draft.
        Only q at the drafted tokens and one row's q (the residual's) are scattered to V. A
        row that gives its own drafted token no mass (a looked-up token, `+ngram`) was not
        drawn from it: it is a deterministic slot, verified as q one-hot at the token.
      target_logits: f32[B, K+1, V] raw target logits at the K drafted positions + 1.
      sampling: applied identically to p (and, by the drafter, to q).
      valid: bool[B, K] or None; an invalid position is a slot where the drafter proposed
        nothing: it is rejected, and the token there is drawn from p itself (q counts as 0).
      w: None (lossless) or f32[B, K] DIVERSED's weight on the target: the verifier's
        distribution is ν = w·p + (1 − w)·q (greedy: its argmax; sampled: accept with
        min(1, ν/q), the residual [ν − q]+ ∝ [p − q]+).
    Returns:
      (n_accepted i32[B] in [0, K], next_token i32[B]): correction or bonus token.
    The decisions are `pallas_kernels.relaxed_acceptance.decide`'s, which the fused kernels and
    their reference also use.
    """
    z, ok, q, row_ids = _chain_inputs(draft, q, target_logits, sampling, valid, q_vocab)
    if sampling.greedy:
        k, v = draft.shape[1], z.shape[-1]
        target_tok = argmax(z)  # [B, K+1]
        choice = target_tok[:, :k]
        if w is not None:
            p = jax.nn.softmax(z[:, :k], axis=-1)
            nu = w[..., None] * p + (1.0 - w[..., None]) * jnp.where(ok[..., None],
                                                                     dense_q(q, row_ids, v), 0.0)
            choice = argmax(nu)
        n, tok, _ = decide_greedy(draft, ok, target_tok, choice, w is not None)
        return n, tok
    k_u, k_s = jax.random.split(key)
    u = jax.random.uniform(k_u, draft.shape)
    n, dist, _ = _decide(u, draft, q, row_ids, z, ok, w)
    return n, sample_from_probs(k_s, dist)


def decide_chain(u: jax.Array, draft: jax.Array, q: jax.Array | None, target_logits: jax.Array,
                 sampling: Sampling, valid: jax.Array | None = None, w: jax.Array | None = None,
                 q_vocab: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`verify_chain`'s sampled (T > 0) decisions for given uniforms u f32[B, K] (`verify_chain`
    draws them from its key): x_i is accepted iff u_i·q(x_i) < ν(x_i), so u = 0 accepts it
    whenever ν(x_i) > 0 and u = inf rejects it. Other arguments as `verify_chain`'s.

    Returns:
      (n i32[B], the distribution the next token is drawn from f32[B, V] (unnormalised: the
      residual at slot n, or p there), prob f32[B, K] min(1, ν/q) per valid slot). An exact
      enumeration (tests/exact_law.py) runs forced uniforms and integrates `prob`.
    """
    z, ok, q, row_ids = _chain_inputs(draft, q, target_logits, sampling, valid, q_vocab)
    return _decide(u, draft, q, row_ids, z, ok, w)


def _chain_inputs(draft, q, target_logits, sampling, valid, q_vocab):
    """(processed target logits f32[B, K+1, V], valid bool[B, K], q f32[B, K, Vq], the target
    id of each q entry i32[B, K, Vq] or None when q is over all V)."""
    b, k = draft.shape
    z = process_logits(target_logits, sampling)  # [B, K+1, V]
    ok = jnp.ones((b, k), bool) if valid is None else valid
    if q is None:  # one-hot at the draft: itself a q over the drafted tokens' ids
        return z, ok, jnp.ones((b, k, 1), jnp.float32), draft[..., None]
    return z, ok, q, None if q_vocab is None else jnp.broadcast_to(q_vocab, q.shape)


def _decide(u, draft, q, row_ids, z, ok, w):
    """`decide_chain` on `_chain_inputs`' arrays."""
    b, k = draft.shape
    v = z.shape[-1]
    p = jax.nn.softmax(z, axis=-1)  # [B, K+1, V]
    p_x = jnp.take_along_axis(p[:, :k], draft[..., None], axis=-1)[..., 0]  # [B, K]
    if row_ids is None:
        q_x = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    else:  # the entry whose target id is the draft (0 when the drafter gave it none)
        q_x = jnp.sum(jnp.where(row_ids == draft[..., None], q, 0.0), axis=-1)
    # No mass at the draft (a looked-up token, or a tail draw whose q underflowed): verified as
    # q one-hot at it, here and in the residual's row (`one_hot_where_deterministic`).
    q_x = jnp.where(q_x <= 0, 1.0, q_x)
    nu_x = p_x if w is None else w * p_x + (1.0 - w) * q_x
    n, row, proposed, prob = accept_sampled(ok, u, q_x, nu_x)
    rows = jnp.arange(b)
    q_row = one_hot_where_deterministic(
        dense_q(q[rows, row], None if row_ids is None else row_ids[rows, row], v),
        draft[rows, row])
    q_n = jnp.where(proposed[:, None], q_row, 0.0)
    return n, residual(p[rows, n], q_n), prob


def residual(p_n: jax.Array, q_n: jax.Array) -> jax.Array:
    """f32[B, V] (unnormalised): [p_n − q_n]+ (f32[B, V] each), or p_n when that mass is
    numerically empty (≤ RESIDUAL_EPS). With q_n = 0 (bonus / empty slot) it is p_n."""
    resid = jnp.maximum(p_n - q_n, 0.0)
    mass = jnp.sum(resid, axis=-1, keepdims=True)
    return jnp.where(mass > RESIDUAL_EPS, resid, p_n)
