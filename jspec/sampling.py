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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling values, traced: other values compile nothing (an RL loop anneals its
    temperature without a recompile). A field left None takes the static `Sampling`'s value for
    every row; a given field is f32[B] / i32[B] (`generate` broadcasts a scalar). Which fields
    are given is static (the pytree's structure).

    Values are not checked (they are traced): a temperature <= 0 makes that row greedy inside
    the sampled program (its distribution is one-hot at the argmax, so its log-probs are 0),
    top_k is clipped to [0, Sampling.top_k] (0 = all), a top_p >= 1 keeps every token.
    """

    temperature: jax.Array | None = None  # f32[B]
    top_k: jax.Array | None = None  # i32[B]
    top_p: jax.Array | None = None  # f32[B]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are chosen. Static under jit: changing a field recompiles.

    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / T).
    top_k: keep the k most likely tokens (0 = all).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1 = all).

    With per-row traced values (`SamplingParams`, `generate(sampling_params=)`) the static
    fields decide the program and the params carry the values: temperature > 0 compiles the
    sampled program (greedy stays a static choice: argmax, no key, no q), top_k > 0 is the
    largest k a row may ask for (`lax.top_k` needs a static k) and is required for a traced
    top_k, and a traced top_p compiles the sort in. `rows` holds those params inside a trace
    (`with_rows`); it is no part of the static identity and never a user's argument.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    rows: SamplingParams | None = dataclasses.field(default=None, compare=False, hash=False,
                                                    repr=False)

    def __post_init__(self) -> None:
        if (not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature)
                or self.temperature < 0):
            raise JspecError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise JspecError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise JspecError(f"top_p must be in (0, 1], got {self.top_p}")

    def __hash__(self) -> int:
        # Per-row values are arrays of one trace: as a static jit argument they would key the
        # cache without their values (a stale constant), so such a Sampling is not hashable.
        if self.rows is not None:
            raise TypeError("a Sampling with per-row values (with_rows) is not static: pass "
                            "the values as a traced jspec.SamplingParams argument")
        return hash((self.temperature, self.top_k, self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_rows(self, params: SamplingParams | None) -> None:
        """JspecError unless `params` fit this static sampling (checked before tracing)."""
        if params is None:
            return
        if not isinstance(params, SamplingParams):
            raise JspecError("sampling_params must be a jspec.SamplingParams, got "
                             f"{type(params).__name__}")
        if self.greedy and any(f is not None for f in (params.temperature, params.top_k,
                                                       params.top_p)):
            raise JspecError("sampling_params with greedy Sampling(): greedy (argmax) is a static "
                             "program; pass Sampling(temperature=1.0) (any T > 0) for the sampled "
                             "one, whose rows take sampling_params' values (a row at temperature "
                             "0 is then greedy)")
        if params.top_k is not None and self.top_k == 0:
            raise JspecError("a traced top_k needs a static bound: pass Sampling(top_k=K) with "
                             "K the largest k a row uses (lax.top_k takes a static k)")

    def with_rows(self, params: SamplingParams | None) -> Sampling:
        """This sampling with per-row traced values (None: itself, the static values)."""
        if params is None:
            return self
        self.check_rows(params)
        return dataclasses.replace(self, rows=params)


def _per_row(a: jax.Array, x: jax.Array) -> jax.Array:
    """a [B] (or a scalar) shaped to broadcast against x [B, ..., V]."""
    a = jnp.asarray(a)
    if a.ndim == 0:
        return a
    if x.ndim < 2 or a.shape[0] != x.shape[0]:
        raise JspecError(f"per-row sampling values of shape {a.shape} for logits of shape "
                         f"{x.shape}: the logits' leading dimension must be the batch")
    return a.reshape(a.shape + (1,) * (x.ndim - 1))


def _scale(x: jax.Array, t: float | jax.Array) -> jax.Array:
    """Shifted logits divided by the temperature; a traced t <= 0 makes its row one-hot at the
    first maximum (NEG elsewhere)."""
    # XLA flushes a subnormal float32 divisor to 0 (0 / 0 = NaN): below float32's normal range
    # scale by 1 / T instead, capped at float32's max (logits 3e-37 apart are one-hot there).
    if not isinstance(t, jax.Array):
        return x / t if t >= _F32.tiny else x * min(1.0 / t, float(_F32.max))
    t = _per_row(t, x)
    safe = jnp.where(t > 0, t, 1.0)
    scaled = jnp.where(t >= _F32.tiny, x / safe,
                       x * jnp.minimum(1.0 / safe, jnp.float32(_F32.max)))
    hot = argmax(x)[..., None] == jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.where(t > 0, scaled, jnp.where(hot, 0.0, NEG))


def _top_k(x: jax.Array, k: int, rows_k: jax.Array | None) -> jax.Array:
    """x with entries below each row's k-th largest set to NEG (`rows_k`: i32[B] per row in
    [0, k], 0 = all; None: the static k for every row)."""
    v = x.shape[-1]
    if rows_k is None:
        if not 0 < k < v:
            return x
        # The smallest of the top k, not `top_k(x, k)[0][..., -1:]`: XLA:CPU compiles that
        # slice into a full sort of the vocabulary instead of its TopK call (k = 50, f32[4, 4,
        # 49152], 2 shared cores: 259 vs 4.7 ms median, 2026-12-07). The same value.
        kth = jnp.min(jax.lax.top_k(x, k)[0], axis=-1, keepdims=True)
        return jnp.where(x < kth, NEG, x)
    cap = min(k, v)
    kr = _per_row(rows_k, x)
    idx = jnp.broadcast_to(jnp.clip(kr, 1, cap) - 1, (*x.shape[:-1], 1)).astype(jnp.int32)
    kth = jnp.take_along_axis(jax.lax.top_k(x, cap)[0], idx, axis=-1)
    return jnp.where((kr > 0) & (x < kth), NEG, x)


def _top_p(x: jax.Array, p: float | jax.Array) -> jax.Array:
    """x with the tail beyond the smallest set reaching mass p set to NEG (p a float, or
    f32[B] per row where p >= 1 keeps every token)."""
    if not isinstance(p, jax.Array) and p >= 1.0:
        return x
    pr = p if not isinstance(p, jax.Array) else _per_row(p, x)
    srt = jnp.sort(x, axis=-1)[..., ::-1]
    cum = jnp.cumsum(jax.nn.softmax(srt, axis=-1), axis=-1)
    # The kept set is every token up to and including the first that reaches top_p.
    n_keep = jnp.sum(cum - jax.nn.softmax(srt, axis=-1) < pr, axis=-1, keepdims=True)
    thresh = jnp.take_along_axis(srt, jnp.maximum(n_keep - 1, 0), axis=-1)
    cut = x < thresh
    if isinstance(p, jax.Array):
        cut = cut & (pr < 1.0)
    return jnp.where(cut, NEG, x)


def process_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """f32[..., V] logits after temperature, top-k and top-p (filtered entries set to NEG).

    Applied identically to target and draft logits, so verification compares the same
    distributions that plain sampling would use. Sampled logits are returned shifted so that
    each row's maximum is 0 (softmax, top-k, top-p and Gumbel-max do not see a shift): with the
    shift taken before dividing, a tiny temperature (1e-38, even below float32's normal range)
    cannot overflow `logits / T` at the maximum, and entries below NEG (-inf once divided) are
    clamped to NEG, so every entry stays finite. Per-row values (`sampling.rows`) take the
    same steps with the row's value (the leading dimension of `logits` is the batch).
    """
    x = logits.astype(jnp.float32)
    if sampling.greedy:
        return x
    rows = sampling.rows or SamplingParams()
    x = x - jnp.max(x, axis=-1, keepdims=True)
    x = _scale(x, sampling.temperature if rows.temperature is None else rows.temperature)
    x = jnp.maximum(x, NEG)
    x = _top_k(x, sampling.top_k, rows.top_k)
    return _top_p(x, sampling.top_p if rows.top_p is None else rows.top_p)


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
