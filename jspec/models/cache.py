"""The KV cache: static capacity, per-row lengths, one buffer for all layers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values, one buffer per layer (updated in place by the forward's layer loop).

    Slots `[0, lengths[b])` of row b hold committed tokens; slots beyond are scratch that a
    forward pass may write (drafted tokens under verification) and a later commit may keep.
    """

    k: tuple[jax.Array, ...]  # L x dtype[B, KV, S, hd] (head-major: see `create`)
    v: tuple[jax.Array, ...]  # L x dtype[B, KV, S, hd]
    lengths: jax.Array  # i32[B] committed slots per row

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @classmethod
    def create(cls, config: ModelConfig, batch: int, capacity: int,
               num_layers: int | None = None) -> KVCache:
        """An empty cache: i32 lengths of zero, zeroed buffers of `capacity` slots.

        Head-major [B, KV, S, hd]: each (row, KV head) is one contiguous [S, hd] matrix, so the
        score and value products of attention are plain batched GEMMs over the buffer as it
        lies (with [B, S, KV, hd], XLA:CPU transposes the whole buffer in every layer of every
        step: at batch 64 and 256 slots attention took 2.9x longer; docs/BENCHMARKS.md), and a
        Pallas tile of one head's slots is one contiguous block.
        """
        layers = config.num_layers if num_layers is None else num_layers
        shape = (batch, config.num_kv_heads, capacity, config.head_dim)
        return cls(k=tuple(jnp.zeros(shape, config.jnp_dtype) for _ in range(layers)),
                   v=tuple(jnp.zeros(shape, config.jnp_dtype) for _ in range(layers)),
                   lengths=jnp.zeros((batch,), jnp.int32))

    def with_lengths(self, lengths: jax.Array) -> KVCache:
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))

    def compact_path(self, start: jax.Array, path: jax.Array) -> KVCache:
        """Move the K/V of a tree's path nodes (written at slots start + node) to contiguous
        slots start + depth, in every layer (what commits an accepted tree path).

        Args:
          start: i32[B] the slot of node 0 (the committed length before the round).
          path: i32[B, D+1] node at each depth (path[:, 0] = 0 stays in place).
        """
        b, d1 = path.shape
        rows = jnp.arange(b)[:, None]
        src = start[:, None] + path[:, 1:]  # [B, D]
        dst = start[:, None] + jnp.arange(1, d1, dtype=jnp.int32)[None]
        ks = tuple(c.at[rows, :, dst].set(c[rows, :, src], mode="drop") for c in self.k)
        vs = tuple(c.at[rows, :, dst].set(c[rows, :, src], mode="drop") for c in self.v)
        return dataclasses.replace(self, k=ks, v=vs)
