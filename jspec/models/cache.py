"""The KV cache: static capacity, per-row lengths, one buffer for all layers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.models.config import ModelConfig
from jspec.sharding import logical

KV_AXES = ("batch", "kv_heads", "seq", "head_dim")  # every K/V buffer: dtype[B, KV, S, hd]

# Verify widths (K + 1, tree nodes) stay on the select path; a prefill takes the scatter.
MAX_SELECT_TOKENS = 16


def write_slots(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """dtype[B, KV, S, hd]: `buf` with new[b, t] written at slot start[b] + t (slots past S
    dropped, never wrapped).

    new: [B, T, KV, hd]; start: i32[B]. How, measured on XLA:CPU (docs/BENCHMARKS.md "Cache
    writes"): one row is a `dynamic_update_slice` of a T-slot window (O(T), in place; the
    window is read first so that slots past S keep their old values). Several rows of a 16-bit
    buffer on CPU: one select over the buffer per new token — XLA:CPU scatters a carried float32
    cache in place but copies a bfloat16 one (30 layers of [64, 3, 256, 64]: 54 ms a step for
    the scatter, 9 ms for one select), and one select over all T tokens gathers per slot and
    recomputes RoPE there (T = 4, batch 16: 209 ms a verify against 92 for T selects).
    Otherwise, and for more than MAX_SELECT_TOKENS new tokens (a prefill: T selects over the
    buffer are O(T·S) work and compile; at batch 8, 128 prompt tokens, a bfloat16 forward took
    46 s to compile), a scatter.
    """
    b, t = new.shape[:2]
    src = jnp.swapaxes(new, 1, 2).astype(buf.dtype)  # [B, KV, T, hd]
    if b == 1 and t <= buf.shape[2]:
        s0 = jnp.minimum(start[0], buf.shape[2] - t)
        old = jax.lax.dynamic_slice_in_dim(buf, s0, t, axis=2)
        j = s0 + jnp.arange(t, dtype=jnp.int32) - start[0]  # window slot -> index into new
        win = jnp.take(src, jnp.clip(j, 0, t - 1), axis=2)
        win = jnp.where(((j >= 0) & (j < t))[None, None, :, None], win, old)
        return jax.lax.dynamic_update_slice_in_dim(buf, win, s0, axis=2)
    if buf.dtype.itemsize >= 4 or jax.default_backend() != "cpu" or t > MAX_SELECT_TOKENS:
        slots = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
        rows = jnp.arange(b, dtype=jnp.int32)[:, None]
        # Indices (rows, :, slots): the indexed dims come first, so the update is [B, T, KV, hd].
        return buf.at[rows, :, slots].set(new.astype(buf.dtype), mode="drop")
    rel = jnp.arange(buf.shape[2], dtype=jnp.int32)[None, :] - start[:, None]  # [B, S]
    for i in range(t):
        buf = jnp.where((rel == i)[:, None, :, None], src[:, :, i:i + 1], buf)
    return buf


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values, one buffer per layer (updated in place by the forward's layer loop).

    Slots `[0, lengths[b])` of row b hold committed tokens; slots beyond are scratch that a
    forward pass may write (drafted tokens under verification) and a later commit may keep.
    """

    k: tuple[jax.Array, ...] = logical(*KV_AXES)  # L x dtype[B, KV, S, hd] (head-major)
    v: tuple[jax.Array, ...] = logical(*KV_AXES)  # L x dtype[B, KV, S, hd]
    lengths: jax.Array = logical("batch")  # i32[B] committed slots per row

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
        from_ = start[:, None] + path[:, 1:]  # [B, D]
        rows = jnp.arange(path.shape[0])[:, None]
        ks = tuple(write_slots(c, c[rows, :, from_], start + 1) for c in self.k)
        vs = tuple(write_slots(c, c[rows, :, from_], start + 1) for c in self.v)
        return dataclasses.replace(self, k=ks, v=vs)
