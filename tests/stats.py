"""Statistics for losslessness tests: per-position two-sample χ², Holm's correction, samplers.

The design every distribution test here follows: many independent rows of ONE prompt, decoded
once autoregressively and once speculatively; at each new-token position t the marginal of
token t over the rows must be the same for both (speculative sampling is exact at every
position, whatever happened before it). One χ² per position, rare tokens pooled into "other",
the positions combined by Holm's step-down correction at an overall α (valid under any
dependence between positions, which share rows). An A/A control (autoregressive against
autoregressive with another key) runs through the same statistic.

Tokens within a row are never pooled into one test: they are dependent, and a pooled χ² over
them rejects far more often than its nominal level.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats as sps

import jspec
from jspec import decode, inputs, platforms, rounds
from jspec.models.cache import KVCache
from jspec.models.llama import forward
from jspec.sampling import probs as probs_of


@dataclasses.dataclass(frozen=True)
class Chi2:
    """One two-sample χ² test of homogeneity (2 × C table)."""

    stat: float
    dof: int
    pvalue: float
    categories: int  # columns after pooling (dof + 1, or 1 when nothing could be tested)


def chi2_two_sample(a: np.ndarray, b: np.ndarray, min_expected: float = 5.0) -> Chi2:
    """Two-sample χ² test that the categories in `a` and `b` (int arrays, any values, e.g.
    token ids with -1 for "ended") come from one distribution.

    Categories whose smaller expected cell count is below `min_expected` are pooled into one
    "other" column; if that column is itself too small it is merged into the smallest kept
    column. No continuity correction. With a single column left the test has no information:
    p = 1 and dof = 0 (callers assert on `categories` to keep tests meaningful).
    """
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    if a.size == 0 or b.size == 0:
        raise ValueError("both samples must be non-empty")
    _, inv = np.unique(np.concatenate([a, b]), return_inverse=True)
    ca = np.bincount(inv[: a.size], minlength=inv.max() + 1).astype(np.float64)
    cb = np.bincount(inv[a.size:], minlength=inv.max() + 1).astype(np.float64)
    col = ca + cb
    n_min = min(a.size, b.size)
    keep = col * n_min / (a.size + b.size) >= min_expected
    table = np.stack([ca[keep], cb[keep]])
    rest = np.asarray([[ca[~keep].sum()], [cb[~keep].sum()]])
    if rest.sum() > 0:
        if rest.sum() * n_min / (a.size + b.size) >= min_expected or table.shape[1] == 0:
            table = np.concatenate([table, rest], axis=1)
        else:
            j = int(np.argmin(table.sum(0)))
            table[:, j] += rest[:, 0]
    c = table.shape[1]
    if c < 2:
        return Chi2(stat=0.0, dof=0, pvalue=1.0, categories=c)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    return Chi2(stat=stat, dof=c - 1, pvalue=float(sps.chi2.sf(stat, c - 1)), categories=c)


def chi2_goodness_of_fit(obs: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> Chi2:
    """χ² goodness of fit of the tokens `obs` (ints in [0, V)) to the distribution `probs`
    f64[V]; categories with expected count below `min_expected` pooled as in
    `chi2_two_sample`. A token outside the support of `probs` gives p = 0."""
    obs = np.asarray(obs).ravel()
    probs = np.asarray(probs, np.float64)
    probs = probs / probs.sum()
    counts = np.bincount(obs, minlength=probs.size).astype(np.float64)
    if counts.size > probs.size or (counts[probs <= 0] > 0).any():
        return Chi2(stat=float("inf"), dof=0, pvalue=0.0, categories=0)
    exp = probs * obs.size
    keep = exp >= min_expected
    o, e = list(counts[keep]), list(exp[keep])
    if (~keep).any() and exp[~keep].sum() > 0:
        if exp[~keep].sum() >= min_expected or not e:
            o.append(counts[~keep].sum())
            e.append(exp[~keep].sum())
        else:
            j = int(np.argmin(e))
            o[j] += counts[~keep].sum()
            e[j] += exp[~keep].sum()
    c = len(o)
    if c < 2:
        return Chi2(stat=0.0, dof=0, pvalue=1.0, categories=c)
    o, e = np.asarray(o), np.asarray(e)
    stat = float(((o - e) ** 2 / e).sum())
    return Chi2(stat=stat, dof=c - 1, pvalue=float(sps.chi2.sf(stat, c - 1)), categories=c)


def holm(pvalues: list[float] | np.ndarray, alpha: float) -> np.ndarray:
    """Holm's step-down procedure: bool[m], which hypotheses are rejected at family-wise level
    `alpha` (the family is rejected iff any is, i.e. iff min p <= alpha / m: Bonferroni's
    global test; Holm only adds which positions)."""
    p = np.asarray(pvalues, np.float64)
    m = p.size
    order = np.argsort(p)
    rejected = np.zeros(m, bool)
    for rank, i in enumerate(order):
        if p[i] > alpha / (m - rank):
            break
        rejected[i] = True
    return rejected


@dataclasses.dataclass(frozen=True)
class PositionTest:
    """Per-position χ² tests between two [N, T] token arrays, combined by Holm."""

    positions: tuple[int, ...]
    tests: tuple[Chi2, ...]
    alpha: float
    rejected: tuple[bool, ...]

    @property
    def same(self) -> bool:
        """No position differs at family-wise level alpha."""
        return not any(self.rejected)

    @property
    def min_p(self) -> float:
        return min(t.pvalue for t in self.tests)

    @property
    def dof(self) -> int:
        return sum(t.dof for t in self.tests)

    def __str__(self) -> str:
        cells = ", ".join(f"t={p}: p={t.pvalue:.2g} (dof {t.dof}){' *' if r else ''}"
                          for p, t, r in zip(self.positions, self.tests, self.rejected,
                                             strict=True))
        return f"Holm at α={self.alpha}: [{cells}]"


def compare_positions(a: np.ndarray, b: np.ndarray, positions: range | list[int],
                      alpha: float = 0.01, min_expected: float = 5.0) -> PositionTest:
    """One `chi2_two_sample` per position (column) of the token arrays a: [Na, T], b: [Nb, T]."""
    a, b = np.asarray(a), np.asarray(b)
    tests = tuple(chi2_two_sample(a[:, t], b[:, t], min_expected) for t in positions)
    rejected = holm([t.pvalue for t in tests], alpha)
    return PositionTest(positions=tuple(positions), tests=tests, alpha=alpha,
                        rejected=tuple(bool(r) for r in rejected))


def fit_positions(tokens: np.ndarray, marginals: dict[int, np.ndarray], alpha: float = 0.01,
                  min_expected: float = 5.0) -> PositionTest:
    """One `chi2_goodness_of_fit` per position t in `marginals` (t -> exact f64[V]) of the
    token array [N, T], combined by Holm."""
    positions = sorted(marginals)
    tests = tuple(chi2_goodness_of_fit(np.asarray(tokens)[:, t], marginals[t], min_expected)
                  for t in positions)
    rejected = holm([t.pvalue for t in tests], alpha)
    return PositionTest(positions=tuple(positions), tests=tests, alpha=alpha,
                        rejected=tuple(bool(r) for r in rejected))


def exact_marginals(model: jspec.Model, prompt: list[int], sampling: jspec.Sampling,
                    upto: int = 2) -> dict[int, np.ndarray]:
    """Exact marginal distributions f64[V] of new tokens 0..upto (upto <= 2) under plain
    sampling from the target, by enumerating every prefix of new tokens (V^upto sequences
    through one forward each: tiny vocabularies only). EOS is not special-cased: use a model
    without EOS ids."""
    if not 0 <= upto <= 2:
        raise ValueError("upto must be 0, 1 or 2")
    v = model.config.vocab_size

    @jax.jit
    def next_probs(seqs):  # i32[M, L] -> f32[M, V] distribution of the next token
        n, w = seqs.shape
        out = forward(model.config, model.weights, seqs, jnp.broadcast_to(jnp.arange(w), (n, w)),
                      KVCache.create(model.config, n, w))
        return probs_of(out.logits[:, -1], sampling)

    base = np.asarray([prompt], np.int32)
    joint = np.asarray(next_probs(base), np.float64)[0]  # P(x_0)
    out = {0: joint}
    prefixes = np.zeros((1, 0), np.int32)  # every (x_0..x_{t-1}), in `joint`'s flat order
    for t in range(1, upto + 1):
        prefixes = np.concatenate([np.repeat(prefixes, v, axis=0),
                                   np.tile(np.arange(v, dtype=np.int32), len(prefixes))[:, None]],
                                  axis=1)
        seqs = np.concatenate([np.repeat(base, len(prefixes), axis=0), prefixes], axis=1)
        cond = np.asarray(next_probs(jnp.asarray(seqs)), np.float64)  # [V^t, V]
        joint = joint.reshape(-1)[:, None] * cond  # P(x_0..x_t)
        out[t] = joint.sum(0)
    return out


# ------------------------------------------------------------------------------------ samplers
@dataclasses.dataclass(frozen=True)
class Rows:
    """Tokens of many independent rows of one prompt and their decoding statistics."""

    tokens: np.ndarray  # i32[N, max_new_tokens], -1 after a row's end
    emitted: int  # Σ over rows of tokens committed by rounds
    rounds: int  # Σ over rows of target verify passes
    accepted: int  # Σ over rows of accepted drafted tokens

    @property
    def tau(self) -> float:
        """Tokens committed per target pass (1.0 for autoregressive decoding)."""
        return self.emitted / max(self.rounds, 1)

    @property
    def accepted_per_row(self) -> float:
        """Accepted drafted tokens per row (counted before the max_new_tokens cut, so also those
        of a row's last round that fall past the end)."""
        return self.accepted / self.tokens.shape[0]


def _rows_of(tokens: list[np.ndarray], stats: list[Any]) -> Rows:
    s = [jax.device_get(x) for x in stats]
    return Rows(tokens=np.concatenate(tokens), emitted=int(sum(x.emitted.sum() for x in s)),
                rounds=int(sum(x.rounds.sum() for x in s)),
                accepted=int(sum(x.accepted.sum() for x in s)))


def generate_rows(model: jspec.Model, prompt: list[int], rows: int, *, batch: int, seed: int,
                  max_new_tokens: int, **kw: Any) -> Rows:
    """`rows` independent rows of `prompt` through `jspec.generate`, `batch` rows per call,
    call c keyed by fold_in(key(seed), c). `kw`: drafter, sampling, length, verifier."""
    if rows % batch:
        raise ValueError("rows must be a multiple of batch")
    ids = np.tile(np.asarray([prompt], np.int32), (batch, 1))
    toks, stats = [], []
    for c in range(rows // batch):
        out = jspec.generate(model, ids, max_new_tokens=max_new_tokens,
                             key=jax.random.fold_in(jax.random.key(seed), c), **kw)
        toks.append(np.asarray(out.tokens))
        stats.append(out.stats)
    return _rows_of(toks, stats)


_STATIC = ("rows", "config", "sampling", "max_new_tokens", "capacity", "eos_ids", "k", "length",
           "platform")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode_after_shared_prefill(weights: Any, drafter: Any, verifier: Any, ids: jax.Array,
                                 lengths: jax.Array, prefill_key: jax.Array, key: jax.Array, *,
                                 rows: int, config: Any, sampling: jspec.Sampling,
                                 max_new_tokens: int, capacity: int, eos_ids: tuple[int, ...],
                                 k: int, length: Any, platform: str | None = None
                                 ) -> tuple[jax.Array, Any]:
    with platforms.compiling_for(platform):  # as `generate` traces: for its platform
        return _shared_prefill_body(weights, drafter, verifier, ids, lengths, prefill_key, key,
                                    rows=rows, config=config, sampling=sampling,
                                    max_new_tokens=max_new_tokens, capacity=capacity,
                                    eos_ids=eos_ids, k=k, length=length)


def _shared_prefill_body(weights: Any, drafter: Any, verifier: Any, ids: jax.Array,
                         lengths: jax.Array, prefill_key: jax.Array, key: jax.Array, *,
                         rows: int, config: Any, sampling: jspec.Sampling, max_new_tokens: int,
                         capacity: int, eos_ids: tuple[int, ...], k: int, length: Any
                         ) -> tuple[jax.Array, Any]:
    kw = dict(sampling=sampling, max_new_tokens=max_new_tokens, capacity=capacity,
              eos_ids=eos_ids, k=k, verifier=verifier, length=length)

    def init(ids, lengths):
        return rounds.init_state(config, weights, drafter, ids, lengths, prefill_key, **kw)

    one = init(ids, lengths)
    # Batched leaves are those whose leading size follows the batch (compare B=1 with B=2).
    two = jax.eval_shape(init, jnp.tile(ids, (2, 1)), jnp.tile(lengths, 2))

    def tile(x, shape):
        if getattr(x, "ndim", 0) and x.shape[0] == 1 and shape.shape[0] == 2:
            return jnp.repeat(x, rows, axis=0)
        return x

    state = jax.tree.map(tile, one, two)
    state = dataclasses.replace(state, key=key)
    round_fn = rounds.make_round(config, weights, drafter, k=k, sampling=sampling,
                                 eos_ids=eos_ids, verifier=verifier, length=length)
    state = rounds.run_rounds(round_fn, state, max_new_tokens - 1)
    return state.tokens, state.stats


def generate_rows_shared_prefill(model: jspec.Model, prompt: list[int], rows: int, *,
                                 batch: int, seed: int, max_new_tokens: int,
                                 drafter: Any = None, sampling: jspec.Sampling,
                                 length: Any = None, verifier: Any = None) -> Rows:
    """As `generate_rows`, but the prompt is prefilled once (one row, key(0)) and its state
    (target cache, drafter state, the first new token) copied into every row: only the
    decode rounds run per row, which is what makes thousands of real-model rows affordable on
    a CPU. Token 0 is therefore the same in every row and in every call with the same
    prompt and sampling (the tests condition on it); rows differ from token 1 on. The rounds
    are `jspec.rounds`' own (`make_round` / `run_rounds`), as in `generate`."""
    if rows % batch:
        raise ValueError("rows must be a multiple of batch")
    ids = inputs.pad_to_bucket(jnp.asarray([prompt], jnp.int32))
    lengths = jnp.asarray([len(prompt)], jnp.int32)
    st = decode._statics(model, ids, drafter, sampling, max_new_tokens, verifier, length, None)
    verifier = st.pop("verifier")
    st.pop("mesh")
    toks, stats = [], []
    for c in range(rows // batch):
        t, s = _decode_after_shared_prefill(
            model.weights, drafter, verifier, ids, lengths, jax.random.key(0),
            jax.random.fold_in(jax.random.key(seed), c), rows=batch, **st)
        toks.append(np.asarray(t))
        stats.append(s)
    return _rows_of(toks, stats)
