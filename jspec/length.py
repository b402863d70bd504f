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

import jax
import jax.numpy as jnp

from jspec.errors import JspecError


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


def parse_length(spec: str) -> FixedLength | LibraSpec:
    """`fixed:K` or `libraspec[:n=N,d_max=D,alpha=A,widths=1/2/4/8]` (the CLI's --length);
    with d_max below the default n and no n given, n = d_max."""
    kind, _, arg = spec.partition(":")
    if kind == "fixed":
        try:
            return FixedLength(int(arg))
        except ValueError as e:
            raise JspecError(f"bad length spec {spec!r}: expected fixed:K") from e
    if kind == "libraspec":
        kw: dict = {}
        for part in filter(None, arg.split(",")):
            key, sep, val = part.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in ("n", "d_max", "alpha", "widths"):
                raise JspecError(f"bad LibraSpec option {part!r}: use n=N, d_max=D, alpha=A, "
                                 "widths=W1/W2/...")
            try:
                if key == "alpha":
                    kw[key] = float(val)
                elif key == "widths":
                    kw[key] = tuple(int(x) for x in val.split("/"))
                else:
                    kw[key] = int(val)
            except ValueError as e:
                raise JspecError(f"bad LibraSpec value in {part!r}") from e
        if "d_max" in kw and "n" not in kw:  # a smaller cap than the default n: n = the cap
            kw["n"] = min(LibraSpec.n, kw["d_max"])
        return LibraSpec(**kw)
    raise JspecError(f"unknown length policy {spec!r} (available: fixed:K, "
                     "libraspec[:n=N,d_max=D,alpha=A])")
