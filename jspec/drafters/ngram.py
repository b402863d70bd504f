"""Prompt/context lookup drafting: continue the latest earlier occurrence of the suffix n-gram."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters.base import Capabilities, ChainDrafter, DraftContext
from jspec.errors import JspecError
from jspec.sampling import Sampling


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class NGram(ChainDrafter):
    """Propose the k tokens that followed the latest earlier match of the longest suffix n-gram.

    n_max..n_min: suffix lengths tried, longest first. Deterministic, so q is one-hot.
    Slots with nothing to propose (no match, or a continuation that runs past the known
    sequence) are -1: verification treats them as rejected, and a round in which no row has a
    proposal costs a one-token forward instead of a k+1-token one.
    """

    n_max: int = 3
    n_min: int = 1
    default_k: int = 5
    max_batch: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.n_min <= self.n_max:
            raise JspecError(f"NGram needs 1 <= n_min <= n_max, got {self.n_min}, {self.n_max}")

    name = "ngram"

    @property
    def caps(self) -> Capabilities:
        return Capabilities(may_abstain=True, default_k=self.default_k,
                            max_batch=self.max_batch)

    def init_state(self, features: Any, prompt_ids: jax.Array, prompt_lengths: jax.Array,
                   capacity: int, *, k: int = 0, verify_width: int = 0) -> None:
        return None

    def lookup(self, seq: jax.Array, seq_len: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        """(tokens i32[B, k] with -1 where nothing is proposed, found bool[B]) for seq i32[B, C]
        with seq_len i32[B] valid entries."""
        b, c = seq.shape
        j = jnp.arange(c, dtype=jnp.int32)[None, :]  # candidate end positions of a match
        best_end = jnp.full((b,), -1, jnp.int32)
        for n in range(self.n_max, self.n_min - 1, -1):
            match = (j >= n - 1) & (j <= seq_len[:, None] - 2)
            for i in range(n):
                tail = jnp.take_along_axis(seq, jnp.maximum(seq_len - 1 - i, 0)[:, None], axis=1)
                shifted = jnp.roll(seq, i, axis=1)  # shifted[:, j] = seq[:, j - i]
                match = match & (shifted == tail)
            end = jnp.max(jnp.where(match, j, -1), axis=1)
            best_end = jnp.where(best_end >= 0, best_end, end)
        found = best_end >= 0
        idx = best_end[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :]
        tokens = jnp.take_along_axis(seq, jnp.clip(idx, 0, c - 1), axis=1)
        known = found[:, None] & (idx < seq_len[:, None])
        return jnp.where(known, tokens, -1), found

    def propose(self, state: None, ctx: DraftContext, k: int, sampling: Sampling,
                key: jax.Array) -> tuple[jax.Array, None, None]:
        tokens, _ = self.lookup(ctx.seq, ctx.cache_len + 1, k)
        return tokens, None, state
