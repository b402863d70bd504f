"""The drafter protocol.

A drafter is a pytree (its weights are leaves, its configuration static) with two methods:
  init_state(target, prompt_ids, prompt_lengths, capacity) -> state pytree
  propose(state, ctx, k, sampling, key) -> (tokens i32[B, k], q f32[B, k, V] | None, state)
`q` is the draft distribution after the same temperature/top-k/top-p processing as the target's,
or None when the draft is deterministic (one-hot: n-gram lookup, or any greedy drafter).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from jspec.sampling import Sampling


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftContext:
    """What a drafter may read about the committed sequence."""

    seq: jax.Array  # i32[B, C] prompt + committed tokens (incl. `last`), junk beyond seq_len
    cache_len: jax.Array  # i32[B] committed tokens in the target cache (all but `last`)
    last: jax.Array  # i32[B] last committed token (= seq[b, cache_len[b]])


class Drafter(Protocol):
    def init_state(self, target: Any, prompt_ids: jax.Array, prompt_lengths: jax.Array,
                   capacity: int) -> Any: ...

    def propose(self, state: Any, ctx: DraftContext, k: int, sampling: Sampling,
                key: jax.Array) -> tuple[jax.Array, jax.Array | None, Any]: ...
