"""ASD: approximate speculative decoding, a budgeted relaxation of greedy verification.

ALGORITHMS.md §2. Greedy only, training-free. A mismatching draft token at block index i
(0-based) with regret r_i = max_v z_i(v) - z_i(x_i) (raw target logits) is admitted when
  r_i / (K - i) <= gate,  mismatches admitted in this block <= cap,
  regret charged in this block <= the row's remaining request budget.
The longest admissible prefix is committed, then the target's argmax after it; later exact
matches in the block are target-greedy under the realised prefix, so no extra target pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.errors import JspecError
from jspec.sampling import Sampling, argmax
from jspec.verify.base import Supports, Verifier
from jspec.verify.lossless import leading_true


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ASDState:
    budget: jax.Array  # f32[B] regret budget left for the request
    ratios: jax.Array  # f32[B, R] r/v at native first rejections (calibration), NaN = unused
    n_ratios: jax.Array  # i32[B] entries written in `ratios`


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ASD(Verifier):
    """Budgeted approximate greedy verification. Static under jit.

    budget: regret budget B per request (persists across rounds); gate: g; cap: m.
    `budget=0`, `gate=0` or `cap=0` is exactly strict greedy verification.
    record: keep r/v at every native first rejection (for `jspec calibrate-asd`).
    """

    budget: float = 8.0
    gate: float = 0.25
    cap: int = 2
    record: bool = False

    def __post_init__(self) -> None:
        if not self.budget >= 0 or not self.gate >= 0:
            raise JspecError(f"ASD budget and gate must be >= 0, got {self.budget}, {self.gate}")
        if not isinstance(self.cap, int) or self.cap < 0:
            raise JspecError(f"ASD cap must be an integer >= 0, got {self.cap!r}")

    @property
    def strict(self) -> bool:
        return self.budget == 0 or self.gate == 0 or self.cap == 0

    name = "ASD"

    @property
    def supports(self) -> Supports:
        """Greedy only; exact only in its strict settings."""
        return Supports(sampled=False, exact=self.strict)

    def init_state(self, batch: int, max_rounds: int) -> ASDState:
        r = max_rounds if self.record else 0
        return ASDState(budget=jnp.full((batch,), self.budget, jnp.float32),
                        ratios=jnp.full((batch, r), jnp.nan, jnp.float32),
                        n_ratios=jnp.zeros((batch,), jnp.int32))

    def verify(self, vstate: ASDState, key: jax.Array, draft: jax.Array, q: jax.Array | None,
               target_logits: jax.Array, sampling: Sampling, valid: jax.Array
               ) -> tuple[jax.Array, jax.Array, ASDState]:
        """(n_accepted i32[B], next_token i32[B], state); shapes as `verify_chain`."""
        b, k = draft.shape
        z = target_logits.astype(jnp.float32)
        top = argmax(z)  # [B, K+1] (first maximum on ties)
        zmax = jnp.max(z[:, :k], axis=-1)
        zx = jnp.take_along_axis(z[:, :k], draft[..., None], axis=-1)[..., 0]
        mism = draft != top[:, :k]
        regret = jnp.where(mism, zmax - zx, 0.0)  # [B, K]
        value = (k - jnp.arange(k)).astype(jnp.float32)[None, :]  # K - i
        charged = jnp.cumsum(regret, axis=1)
        if self.strict:
            admit = jnp.zeros_like(mism)
        else:
            admit = ((regret <= self.gate * value) & (jnp.cumsum(mism, axis=1) <= self.cap)
                     & (charged <= vstate.budget[:, None]))
        n = leading_true(valid & (~mism | admit))
        spent = jnp.where(n > 0, jnp.take_along_axis(charged, jnp.maximum(n - 1, 0)[:, None],
                                                      axis=1)[:, 0], 0.0)
        nxt = jnp.take_along_axis(top, n[:, None], axis=1)[:, 0]
        new = dataclasses.replace(vstate, budget=vstate.budget - spent)
        if self.record:
            first = leading_true(valid & ~mism)  # native (strict) first rejection
            rows = jnp.arange(b)
            at = jnp.minimum(first, k - 1)
            ratio = regret[rows, at] / value[0, at]
            ok = (first < k) & valid[rows, at] & (ratio > 0)
            slot = jnp.where(ok, vstate.n_ratios, vstate.ratios.shape[1])
            new = dataclasses.replace(
                new, ratios=vstate.ratios.at[rows, slot].set(ratio, mode="drop"),
                n_ratios=vstate.n_ratios + ok)
        return n, nxt, new
