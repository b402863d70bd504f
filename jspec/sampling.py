"""Sampling configuration and the logits -> distribution processing shared by every verifier."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jspec.errors import JspecError

NEG = -1e30  # finite "minus infinity" for filtered logits
_F32 = np.finfo(np.float32)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are chosen. Static under jit: changing a field recompiles.

    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / T).
    top_k: keep the k most likely tokens (0 = all).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1 = all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if (not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature)
                or self.temperature < 0):
            raise JspecError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise JspecError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise JspecError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """f32[..., V] logits after temperature, top-k and top-p (filtered entries set to NEG).

    Applied identically to target and draft logits, so verification compares the same
    distributions that plain sampling would use. Sampled logits are returned shifted so that
    each row's maximum is 0 (softmax, top-k, top-p and Gumbel-max do not see a shift): with the
    shift taken before dividing, a tiny temperature (1e-38, even below float32's normal range)
    cannot overflow `logits / T` at the maximum, and entries below NEG (-inf once divided) are
    clamped to NEG, so every entry stays finite.
    """
    x = logits.astype(jnp.float32)
    if sampling.greedy:
        return x
    x = x - jnp.max(x, axis=-1, keepdims=True)
    t = sampling.temperature
    # XLA flushes a subnormal float32 divisor to 0 (0 / 0 = NaN): below float32's normal range
    # scale by 1 / T instead, capped at float32's max (logits 3e-37 apart are one-hot there).
    x = x / t if t >= _F32.tiny else x * min(1.0 / t, float(_F32.max))
    x = jnp.maximum(x, NEG)
    v = x.shape[-1]
    if 0 < sampling.top_k < v:
        kth = jax.lax.top_k(x, sampling.top_k)[0][..., -1:]
        x = jnp.where(x < kth, NEG, x)
    if sampling.top_p < 1.0:
        srt = jnp.sort(x, axis=-1)[..., ::-1]
        cum = jnp.cumsum(jax.nn.softmax(srt, axis=-1), axis=-1)
        # The kept set is every token up to and including the first that reaches top_p.
        n_keep = jnp.sum(cum - jax.nn.softmax(srt, axis=-1) < sampling.top_p, axis=-1,
                         keepdims=True)
        thresh = jnp.take_along_axis(srt, jnp.maximum(n_keep - 1, 0), axis=-1)
        x = jnp.where(x < thresh, NEG, x)
    return x


def argmax(x: jax.Array) -> jax.Array:
    """i32[...]: the index of the first maximum of f32[..., V] (`jnp.argmax`'s answer, NaN
    rows included: the first NaN).

    Two plain reductions (the maximum, then the smallest index holding it): XLA:CPU runs
    `jnp.argmax`'s paired (value, index) reduction 3-4x slower over a 49,152-token vocabulary
    (batch 64: 7.2 vs 2.4 ms; `git show 9eeace3:scripts/argmax_speed.py`), once per decode step.
    """
    m = jnp.max(x, axis=-1, keepdims=True)
    v = x.shape[-1]
    hit = (x == m) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """i32[...]: one draw per row of f32[..., V] logits, the same draw as
    `jax.random.categorical(key, logits, axis=-1)` (Gumbel-max with its Gumbel noise) with the
    faster `argmax`."""
    return argmax(jax.random.gumbel(key, logits.shape, logits.dtype) + logits)


def probs(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """f32[..., V]: the distribution tokens are drawn from (one-hot argmax when greedy)."""
    x = process_logits(logits, sampling)
    if sampling.greedy:
        return jax.nn.one_hot(argmax(x), x.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(x, axis=-1)


def token_logprobs(logits: jax.Array, tokens: jax.Array, sampling: Sampling) -> jax.Array:
    """f32[...]: log p(token) of i32[...] tokens under f32[..., V] logits' processed
    distribution (temperature, top-k, top-p: the one sampled from; greedy: the plain softmax).

    Written as `jax.nn.softmax` computes it (the maximum, exp of the shifted logits, their
    sum), so that inside a verify pass XLA shares those reductions with the verifier's own
    softmax of the same processed logits."""
    return processed_logprobs(process_logits(logits, sampling), tokens)


def processed_logprobs(z: jax.Array, tokens: jax.Array) -> jax.Array:
    """f32[...]: log softmax(z)[token] of i32[...] tokens for `process_logits`' output z
    f32[..., V]."""
    m = jnp.max(z, axis=-1, keepdims=True)
    s = jnp.sum(jnp.exp(z - m), axis=-1, keepdims=True)
    z_tok = jnp.take_along_axis(z, tokens[..., None], axis=-1)
    return (z_tok - m - jnp.log(s))[..., 0]


def sample(key: jax.Array, logits: jax.Array, sampling: Sampling) -> jax.Array:
    """i32[...]: one token per row of f32[..., V] logits."""
    x = process_logits(logits, sampling)
    if sampling.greedy:
        return argmax(x)
    return categorical(key, x)


def sample_with_logprobs(key: jax.Array, logits: jax.Array, sampling: Sampling
                         ) -> tuple[jax.Array, jax.Array]:
    """(i32[...] one token per row of f32[..., V] logits, f32[...] its log p under the
    processed distribution): `sample` and `token_logprobs` over one processing of the logits
    (top-p sorts the vocabulary; once per step, not twice)."""
    x = process_logits(logits, sampling)
    tok = argmax(x) if sampling.greedy else categorical(key, x)
    return tok, processed_logprobs(x, tok)


def sample_from_probs(key: jax.Array, p: jax.Array) -> jax.Array:
    """i32[...]: one token per row of f32[..., V] probabilities (need not be normalised)."""
    return categorical(key, jnp.log(jnp.maximum(p, 0.0)))


def one_hot_where_deterministic(q: jax.Array, tokens: jax.Array) -> jax.Array:
    """f32[..., V]: q over all V with every row that gives its own token (i32[...]) no mass
    replaced by one-hot at that token, which verification then treats as a deterministic slot.
    Such a row marks a token not drawn from q (a looked-up one, `+ngram`), or a token drawn
    from q whose probability underflowed float32: drafters draw from log-probabilities, so at
    low temperature a tail token can be drawn with q = 0 in float32. Both are verified exactly:
    one-hot verification (accept with p(x), else draw from p without x) emits law p whatever
    proposed x, and the tokens with mass are drawn with probabilities proportional to q
    (`jspec.verify.tree.verify_tree_drawn`)."""
    hot = jax.nn.one_hot(tokens, q.shape[-1], dtype=q.dtype)
    q_x = jnp.take_along_axis(q, tokens[..., None], axis=-1)
    return jnp.where(q_x <= 0, hot, q)


def dense_q(q: jax.Array | None, q_vocab: jax.Array | None, v: int) -> jax.Array | None:
    """q f32[..., Vq] over the target ids `q_vocab` as f32[..., V]. `q_vocab` is i32[Vq] (one
    vocabulary for every row), i32[..., Vq] (each row its own ids, q's shape), or None (q is
    already over all V)."""
    if q is None or q_vocab is None:
        return q
    if q_vocab.ndim == 1:
        return jnp.zeros((*q.shape[:-1], v), q.dtype).at[..., q_vocab].set(q)
    rows = q.reshape(-1, q.shape[-1])
    ids = jnp.broadcast_to(q_vocab, q.shape).reshape(rows.shape)
    out = jax.vmap(lambda a, i: jnp.zeros((v,), a.dtype).at[i].set(a))(rows, ids)
    return out.reshape(*q.shape[:-1], v)
