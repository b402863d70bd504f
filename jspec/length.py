"""How many drafted tokens a round verifies: a fixed K, or LibraSpec's per-row dynamic length.

LibraSpec (ALGORITHMS.md §4). With drafter confidences q_k (jspec uses each slot's maximum
draft probability, fixed before the slot's token is drawn — never the sampled token's own
probability, which would bias the output at T > 0) and the current length d, for i = 1..d

    ε_i = ⌊α · Σ_{j=i..d} Π_{k=i..j} q_k + i⌋,      ε* = min_i ε_i.

Algorithm 1: draft n tokens, d = n; if ε* ≤ d, verify the first ε* and stop; otherwise extend
d to min(ε*, d_max), drafting more blocks when the drafted tokens run out, and repeat. At T > 0
a block anchored on a sampled token never lets the length be cut below that token's slot, so
whether a slot is verified never depends on its own token (docs/ARCHITECTURE.md, "LibraSpec at
T > 0"): exact at every temperature.

Static shapes: every row's d lives in [1, d_max]; the round verifies `width(max live d)`
tokens, the smallest of a few static widths (a `lax.switch` over one compiled forward per
width), with the slots beyond a row's d marked empty (the verifier rejects them and draws the
token there from the target itself, so verification stays exact). Nothing recompiles as d
varies.

α and the cost curve. The marginal criterion extends d → d+1 when the extra expected accepted
token is worth the extra verify cost: with T(d) = t₁·(c(d+1) + drafting), extend iff
P(x_1..x_{d+1} accepted) · T(d) / (T(d+1) − T(d)) > τ_d. The steeper c(K), the less a token is
worth and the smaller α must be. jspec does not use a constant: `python -m jspec
calibrate-length` measures this machine's c(K) for every static width and the drafter's
per-block cost, records confidences and oracle lengths on real prompts, and picks the α that
maximises the simulated tokens per unit time; run it on the device you decode on (a TPU/GPU has
a much flatter c(K), hence a larger α) and pass `--length libraspec:alpha=A`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters.base import Capabilities, DraftContext, Proposal
from jspec.errors import JspecError
from jspec.sampling import Sampling
from jspec.specs import Registry, ints


@dataclasses.dataclass(frozen=True)
class FixedLength:
    """Verify exactly `k` drafted tokens every round (static: changing k recompiles)."""

    k: int = 5

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or not 1 <= self.k <= 64:
            raise JspecError(f"speculation length k must be an integer in [1, 64], got {self.k!r}")

    @property
    def max_k(self) -> int:
        return self.k

    # The length-policy protocol (what `jspec.rounds.speculative_round` calls).
    oracle_pass = False  # the oracle length is the accepted count: no second verify

    def draft_sizes(self, caps: Capabilities) -> tuple[int, int]:
        """(tokens per `draft`, the longest path a verify accepts) for the drafter's state."""
        return self.k, caps.path_len(self.k)

    def verify_widths_for(self, caps: Capabilities) -> tuple[int, ...]:
        """Static verify widths (nodes after `last`): the drafter's `caps.verify_widths(k)` —
        the proposal's nodes, and the fewer nodes some rounds' rows fill (a chain proposer's
        inner chain of k inside longer looked-up chains, a tree's looked-up chain); a drafter
        that may abstain also gets width 0, a one-token forward when no live row proposed
        anything. The round verifies the smallest width its live rows need."""
        widths = caps.verify_widths(self.k)
        return (0, *widths) if caps.may_abstain else widths

    def draft(self, drafter: Any, dstate: Any, ctx: DraftContext, sampling: Sampling,
              key: jax.Array, live: jax.Array
              ) -> tuple[Proposal, Any, jax.Array, jax.Array]:
        """(proposal of N nodes, drafter state, d i32[B] nodes each row verifies, the width
        the batch needs i32[]: one past the last proposed node of any live row): k tokens (or
        `caps.lookahead(k)` nodes), all verified."""
        prop, dstate = drafter.draft(dstate, ctx, self.k, sampling, key)
        n = prop.tokens.shape[1]
        d = jnp.full(live.shape, n, jnp.int32)
        upto = jnp.arange(1, n + 1, dtype=jnp.int32)[None]  # [1, N]
        need = jnp.max(jnp.where(live[:, None] & (prop.tokens >= 0), upto, 0))
        return prop, dstate, d, need


def default_widths(d_max: int) -> tuple[int, ...]:
    """Static verify widths: powers of two below d_max, and d_max."""
    w, out = 1, []
    while w < d_max:
        out.append(w)
        w *= 2
    return (*out, d_max)


@dataclasses.dataclass(frozen=True)
class LibraSpec:
    """Per-row speculation length from the drafter's confidences (static config, hashable).

    Attributes:
      n: tokens drafted before the first decision.
      d_max: the cap (and the static maximum verify width).
      alpha: the cost constant of the ε rule (calibrate with `jspec calibrate-length`).
      widths: the static verify widths the round chooses among (default: powers of two and
        d_max); more widths verify closer to d but compile one forward each.
    """

    n: int = 16
    d_max: int = 24
    alpha: float = 2.2
    widths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or not isinstance(self.d_max, int):
            raise JspecError("LibraSpec n and d_max must be integers")
        if not 1 <= self.n <= self.d_max <= 64:
            raise JspecError(f"LibraSpec needs 1 <= n <= d_max <= 64, got n={self.n}, "
                             f"d_max={self.d_max}")
        if not (isinstance(self.alpha, (int, float)) and 0 < self.alpha <= 1e9):
            raise JspecError(f"LibraSpec alpha must be a positive number, got {self.alpha!r}")
        if self.widths is not None:
            w = tuple(self.widths)
            if (not w or list(w) != sorted(set(w)) or w[0] < 1 or w[-1] != self.d_max
                    or not all(isinstance(x, int) for x in w)):
                raise JspecError(f"LibraSpec widths must be increasing integers >= 1 ending at "
                                 f"d_max={self.d_max}, got {self.widths!r}")
            object.__setattr__(self, "widths", w)

    @property
    def max_k(self) -> int:
        return self.d_max

    @property
    def verify_widths(self) -> tuple[int, ...]:
        return self.widths or default_widths(self.d_max)

    # The length-policy protocol (see FixedLength).
    oracle_pass = True  # at T = 0 a second, cheap verify over every drafted slot: the oracle

    def draft_sizes(self, caps: Capabilities) -> tuple[int, int]:
        return min(self.n, caps.block_tokens), self.d_max

    def verify_widths_for(self, caps: Capabilities) -> tuple[int, ...]:
        return self.verify_widths

    def draft(self, drafter: Any, dstate: Any, ctx: DraftContext, sampling: Sampling,
              key: jax.Array, live: jax.Array
              ) -> tuple[Proposal, Any, jax.Array, jax.Array]:
        """Algorithm 1 per row over the drafter's confidences: `libraspec_draft`."""
        return libraspec_draft(self, drafter, dstate, ctx, sampling, key, live)


def libraspec_draft(policy: LibraSpec, drafter: Any, dstate: Any, ctx: DraftContext,
                    sampling: Sampling, key: jax.Array, live: jax.Array
                    ) -> tuple[Proposal, Any, jax.Array, jax.Array]:
    """LibraSpec's proposal: d_max drafted slots and each row's length d.

    Draft min(n, b) tokens in a first block (b = `caps.block_tokens`), then whole blocks of b
    until n are drafted; then Algorithm 1 as a bounded fixed-point iteration: ε* over the first
    d confidences either cuts d (ε* ≤ d) or extends it to min(ε*, d_max), and a further block
    is drafted (`lax.cond`, only if a live row needs it). The round verifies [last, x_1..x_W]
    for W the smallest static width ≥ the largest live d; slots beyond a row's own d are not
    verified, so the verifier rejects there and draws the token from the target (exact). At
    T > 0 the confidences are max-probabilities (fixed before each token is drawn) and a block
    anchored on a sampled token raises the row's floor to that token's slot (`raise_floor`):
    whether a slot is verified never depends on its own token, so sampling stays exact.
    """
    bs = drafter.caps.block_tokens
    k1 = min(policy.n, bs)  # the first block drafts n tokens (at most a full block)
    n0 = 1 + -(-(policy.n - k1) // bs)  # blocks drafted before the first decision
    nb = 1 + -(-(policy.d_max - k1) // bs)  # most blocks a round may draft

    def end(j: int) -> int:  # drafted tokens once blocks 0..j exist
        return k1 + j * bs
    b = ctx.last.shape[0]
    keys = jax.random.split(key, nb)

    first, dstate = drafter.draft(dstate, ctx, k1, sampling, keys[0])
    total = end(nb - 1)
    toks = jnp.zeros((b, total), jnp.int32).at[:, :k1].set(first.tokens)
    confs = jnp.zeros((b, total), jnp.float32).at[:, :k1].set(first.conf[:, :k1])
    q0 = first.q
    qs = None if q0 is None else jnp.zeros((b, total, q0.shape[-1]), q0.dtype).at[:, :k1].set(q0)

    def add_block(j, toks, confs, qs):
        lo = end(j - 1)
        anchor = jnp.maximum(toks[:, lo - 1], 0)
        t, q, c = drafter.extend(dstate, ctx, anchor, lo, sampling, keys[j])
        toks = toks.at[:, lo:lo + bs].set(t)
        confs = confs.at[:, lo:lo + bs].set(c)
        if qs is not None:
            qs = qs.at[:, lo:lo + bs].set(q)
        return toks, confs, qs

    for j in range(1, n0):
        toks, confs, qs = add_block(j, toks, confs, qs)
    # A drafted slot the drafter left empty (-1, e.g. a VAT cut) ends what can be accepted:
    # its confidence is 0 from there on.
    confs = jnp.where(jnp.cumsum(toks < 0, axis=1) > 0, 0.0, confs)

    def settle(c, have):
        """Iterate Algorithm 1 for every row whose next length is already drafted; a cut
        never goes below the row's floor."""
        def body(c):
            d, want, stop, floor, _, confs = c
            ready = ~stop & (want <= have)
            d = jnp.where(ready, want, d)
            eps = epsilon_star(confs, d, policy.alpha)
            cut = ready & (eps <= d)
            cap = ready & ~cut & (d >= policy.d_max)
            d = jnp.where(cut, jnp.maximum(eps, floor), d)
            want = jnp.where(ready & ~cut & ~cap, jnp.minimum(eps, policy.d_max),
                             jnp.where(cut | cap, d, want))
            stop = stop | cut | cap
            return d, want, stop, floor, jnp.any(~stop & (want <= have)), confs

        d, want, stop, floor, _, _ = jax.lax.while_loop(
            lambda c: c[4], body, (*c, jnp.bool_(True), confs))
        return d, want, stop, floor

    def raise_floor(dws, j):
        """Exactness at T > 0 (ARCHITECTURE "LibraSpec at T > 0"): block j is anchored on the
        sampled token at slot end(j-1), so its confidences depend on that draw; once a row
        drafts it, the row's length is never cut below end(j-1) — whether slot s is verified
        then depends only on draws before s. Greedy tokens are not random: no floor."""
        if sampling.greedy:
            return dws
        d, want, stop, floor = dws
        return d, want, stop, jnp.where(stop, floor, end(j - 1))

    n_first = jnp.full((b,), policy.n, jnp.int32)
    dws = (n_first, n_first, ~live, jnp.zeros((b,), jnp.int32))  # (d, want, stop, floor)
    for j in range(1, n0):
        dws = raise_floor(dws, j)
    dws = settle(dws, end(n0 - 1))
    for j in range(n0, nb):
        need = jnp.any(~dws[2] & (dws[1] > end(j - 1)))  # a live row waits for block j
        toks, confs, qs = jax.lax.cond(
            need, lambda a, j=j: add_block(j, *a), lambda a: a, (toks, confs, qs))
        dws = settle(raise_floor(dws, j), end(j))
    d = jnp.clip(dws[0], 1, policy.d_max)
    prop = Proposal(tokens=toks[:, :policy.d_max], q=None if qs is None else qs[:, :policy.d_max],
                    q_vocab=first.q_vocab,
                    conf=confs[:, :policy.d_max])
    return prop, dstate, d, jnp.max(jnp.where(live, d, 1))


def epsilon_star(conf: jax.Array, d: jax.Array, alpha: float) -> jax.Array:
    """ε* = min_{i=1..d} ⌊α·Σ_{j=i..d} Π_{k=i..j} q_k + i⌋ per row.

    Args:
      conf: f32[B, D] confidences q_1..q_D (entries beyond a row's d are ignored).
      d: i32[B] current length, 1 <= d <= D.
    Returns:
      i32[B] ε*, >= 1.
    """
    _, width = conf.shape
    idx = jnp.arange(width)
    inside = idx[None, :] < d[:, None]  # [B, D] positions 1..d (0-based < d)
    q = jnp.where(inside, conf, 0.0).astype(jnp.float32)
    # S_i = Σ_{j≥i} Π_{k=i..j} q_k = q_i (1 + S_{i+1}), computed right to left.
    def step(s_next, q_i):
        s = q_i * (1.0 + s_next)
        return s, s

    _, s = jax.lax.scan(step, jnp.zeros(q.shape[0], jnp.float32), q.T, reverse=True)
    s = s.T  # [B, D]
    eps = jnp.floor(alpha * s + (idx[None, :] + 1).astype(jnp.float32)).astype(jnp.int32)
    eps = jnp.where(inside, eps, jnp.iinfo(jnp.int32).max)
    return jnp.min(eps, axis=1)


def _fixed(k: int | None = None) -> FixedLength:
    if k is None:
        raise JspecError("bad length spec 'fixed': expected fixed:K")
    return FixedLength(k)


def _libraspec(**kw: Any) -> LibraSpec:
    if "d_max" in kw and "n" not in kw:  # a smaller cap than the default n: n = the cap
        kw["n"] = min(LibraSpec.n, kw["d_max"])
    return LibraSpec(**kw)


LENGTHS = Registry("length policy")
LENGTHS.register("fixed", _fixed, {"k": int}, positional="k", usage="K")
LENGTHS.register("libraspec", _libraspec,
                 {"n": int, "d_max": int, "alpha": float, "widths": ints},
                 usage="n=N,d_max=D,alpha=A,widths=W1/W2/...")


def parse_length(spec: str) -> FixedLength | LibraSpec:
    """`fixed:K` or `libraspec[:n=N,d_max=D,alpha=A,widths=1/2/4/8]` (the CLI's --length);
    with d_max below the default n and no n given, n = d_max."""
    return LENGTHS.parse(spec)
