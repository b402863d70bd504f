"""The KV cache: static capacity, per-row lengths, one buffer for all layers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer, stacked so the layer `scan` updates them in its carry.

    Slots `[0, lengths[b])` of row b hold committed tokens; slots beyond are scratch that a
    forward pass may write (drafted tokens under verification) and a later commit may keep.
    """

    k: jax.Array  # dtype[L, B, S, KV, hd]
    v: jax.Array  # dtype[L, B, S, KV, hd]
    lengths: jax.Array  # i32[B] committed slots per row

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @classmethod
    def create(cls, config: ModelConfig, batch: int, capacity: int,
               num_layers: int | None = None) -> KVCache:
        """An empty cache: i32 lengths of zero, zeroed buffers of `capacity` slots."""
        layers = config.num_layers if num_layers is None else num_layers
        shape = (layers, batch, capacity, config.num_kv_heads, config.head_dim)
        return cls(k=jnp.zeros(shape, config.jnp_dtype), v=jnp.zeros(shape, config.jnp_dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))

    def with_lengths(self, lengths: jax.Array) -> KVCache:
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))
