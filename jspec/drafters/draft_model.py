"""An independent draft model (any Llama-family model sharing the target's tokenizer)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters.base import Capabilities, ChainDrafter, DraftContext
from jspec.models.cache import KVCache
from jspec.models.config import ModelConfig
from jspec.models.llama import Weights, forward
from jspec.sampling import Sampling, argmax, categorical, process_logits


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftModelState:
    cache: KVCache  # the draft's own cache; valid for slots < target cache_len - 1 at propose


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftModel(ChainDrafter):
    """Draft with a small model: k autoregressive steps, keeping each step's full q.

    `num_layers` < config.num_layers runs only the first layers (plus final norm and head):
    `early-exit:N` uses the target's own weights that way (`shares_target`: `bind` gives it
    a target's new weights).
    """

    weights: Weights
    config: ModelConfig = dataclasses.field(metadata=dict(static=True))
    num_layers: int = dataclasses.field(metadata=dict(static=True), default=0)
    name: str = dataclasses.field(metadata=dict(static=True), default="draft")
    default_k: int = dataclasses.field(metadata=dict(static=True), default=5)
    max_batch: int | None = dataclasses.field(metadata=dict(static=True), default=None)
    shares_target: bool = dataclasses.field(metadata=dict(static=True), default=False)

    @property
    def caps(self) -> Capabilities:
        return Capabilities()

    @property
    def layers(self) -> int:
        return self.num_layers or self.config.num_layers

    def init_state(self, features: Any, prompt_ids: jax.Array, prompt_lengths: jax.Array,
                   capacity: int, *, k: int = 0, verify_width: int = 0) -> DraftModelState:
        b, p = prompt_ids.shape
        cache = KVCache.create(self.config, b, capacity, num_layers=self.layers)
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        out = forward(self.config, self.weights, prompt_ids, pos, cache, compute_logits=False,
                      num_layers=self.layers)
        return DraftModelState(cache=out.cache.with_lengths(prompt_lengths))

    def propose(self, state: DraftModelState, ctx: DraftContext, k: int, sampling: Sampling,
                key: jax.Array) -> tuple[jax.Array, jax.Array | None, DraftModelState]:
        """Draft k tokens. The first step re-feeds [token before last, last], which also
        catches the draft cache up when the previous round accepted every drafted token."""
        L = ctx.cache_len
        prev = jnp.take_along_axis(ctx.seq, (L - 1)[:, None], axis=1)[:, 0]
        cache = state.cache.with_lengths(L - 1)
        toks = jnp.stack([prev, ctx.last], axis=1)
        pos = (L - 1)[:, None] + jnp.arange(2, dtype=jnp.int32)[None]
        keys = jax.random.split(key, k)

        def step_out(out, i):
            z = process_logits(out.logits[:, -1], sampling)
            if sampling.greedy:
                return argmax(z), None
            return (categorical(keys[i], z),
                    jax.nn.softmax(z, axis=-1))

        out = forward(self.config, self.weights, toks, pos, cache, num_layers=self.layers)
        x, q = step_out(out, 0)
        cache = out.cache.with_lengths(L + 1)

        def body(carry, i):
            cache, x = carry
            o = forward(self.config, self.weights, x[:, None], cache.lengths[:, None], cache,
                        num_layers=self.layers)
            nx, nq = step_out(o, i)
            return (o.cache.with_lengths(cache.lengths + 1), nx), (nx, nq)

        if k > 1:
            (cache, _), (xs, qs) = jax.lax.scan(body, (cache, x), jnp.arange(1, k))
            tokens = jnp.concatenate([x[:, None], xs.T], axis=1)
            probs = None if q is None else jnp.concatenate([q[:, None], qs.swapaxes(0, 1)], axis=1)
        else:
            tokens, probs = x[:, None], None if q is None else q[:, None]
        return tokens, probs, DraftModelState(cache=cache)
