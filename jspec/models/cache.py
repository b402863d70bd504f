"""The KV cache: static capacity, per-row lengths, one buffer for all layers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec import platforms
from jspec.models.config import ModelConfig
from jspec.sharding import logical

KV_AXES = ("batch", "kv_heads", "seq", "head_dim")  # every K/V buffer: dtype[B, KV, S, hd]


def storage_dtype(dtype, platform: str | None = None) -> jnp.dtype:
    """The dtype a K/V buffer of model dtype `dtype` is stored in, in a program compiled for
    `platform` (default `jspec.platforms.target()`): bfloat16 as its uint16 bits on CPU (and
    where the platform is not known yet), as itself on TPU and GPU.

    Off CPU the bits buy nothing and cost a copy: on TPU a bitcast of a stacked cache
    (scanned layers) to bfloat16 was a converted copy of the whole stack in every layer
    (Llama-3.1-8B, 8 v5e chips: an AR step read 2.07x its floor). XLA:CPU computes bfloat16
    selects and scatters in float32, and a bfloat16 cache carried
    through the decode loop became a float32 one: at batch 256 and 512 slots the planned
    temporaries were the same 6.7 GB in both dtypes (docs/BENCHMARKS.md "Batch 256 at 512
    slots"). Integer bits are written in place and read back by a free bitcast in attention.
    """
    dtype = jnp.dtype(dtype)
    platform = platform or platforms.target()
    bits = dtype == jnp.bfloat16 and platform in (None, "cpu")
    return jnp.dtype(jnp.uint16) if bits else dtype


def to_storage(x: jax.Array, buf_dtype) -> jax.Array:
    """x (any float dtype, or already the buffer's own elements: a slot moved within the cache)
    as the elements of a K/V buffer of `buf_dtype` (`storage_dtype`)."""
    if x.dtype == jnp.dtype(buf_dtype):
        return x
    if jnp.dtype(buf_dtype) == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(buf_dtype)


def from_storage(buf: jax.Array, dtype) -> jax.Array:
    """The values of a K/V buffer (`storage_dtype`) in `dtype` (a free bitcast for uint16)."""
    if buf.dtype == jnp.uint16:
        buf = jax.lax.bitcast_convert_type(buf, jnp.bfloat16)
    return buf.astype(dtype)


def write_slots(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """dtype[B, KV, S, hd]: `buf` with new[b, t] written at slot start[b] + t (slots past S
    dropped, never wrapped).

    new: [B, T, KV, hd]; start: i32[B] (a stacked cache: `write_stack`). How, measured on
    XLA:CPU (docs/BENCHMARKS.md "Cache writes"): one row is a `dynamic_update_slice` of a
    T-slot window (O(T), in place; the window is read first so that slots past S keep their
    old values); several rows a scatter,
    in place for float32 and for bfloat16 stored as uint16 bits (`storage_dtype`). (Before
    that storage, a bfloat16 scatter copied the buffer, 54 ms a step at batch 64, and T
    selects over the buffer were the faster way; batch 16, T = 4, bfloat16: 107-118 ms a
    verify step with the selects, 102-124 ms with the uint16 scatter, alternating runs.)
    """
    b, t = new.shape[:2]
    src = to_storage(jnp.swapaxes(new, 1, 2), buf.dtype)  # [B, KV, T, hd]
    if t > buf.shape[2]:
        return _scatter_rows(buf, src, start)
    if b == 1:
        return _write_windows(buf, src, start)
    # Several rows: a scatter on CPU (in place there, see above). Elsewhere, for one new token
    # per row (a decode step), one in-place window per row, up to MAX_WINDOW_ROWS rows (each is
    # its own instruction): on 8 v5e chips the scatter's buffer went through VMEM and was
    # copied back to HBM whole every step (Llama-3.1-8B, batch 8: 0.54 GB written; windows
    # 0.017 GB). For several tokens per row the scatter: on one v6e chip (batch 8, T = 5) it
    # reads the floor and writes 0.03 GB, the windows 25.5 GB and 9.4 GB (docs/TPU.md).
    if b > MAX_WINDOW_ROWS or t > 1:
        return _scatter_rows(buf, src, start)
    return platforms.choose(buf, src, start, cpu=_scatter_rows, default=_write_windows)


MAX_WINDOW_ROWS = 32


def write_stack(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """dtype[L, B, KV, S, hd]: a stacked cache with new[l, b, t] written at slot start[b] + t of
    layers l < new.shape[0] (slots past S dropped), every layer in one scatter, in place.

    new: [L', B, T, KV, hd]; start: i32[B]. Each (layer, row, slot) is its own index, the
    window only (KV, hd): with the layer axis a window (or the per-layer write mapped over the
    stack) XLA:TPU transposed the whole stack for the scatter and back (4 x 268 MB a step on
    each of 8 v5e chips, Llama-3.1-8B batch 8, T = 5); per-row windows over all layers 7.8 GB
    read; this form reads the step's floor and writes 3 MB (docs/TPU.md).
    """
    n, b, t = new.shape[:3]
    layers = jnp.arange(n, dtype=jnp.int32)[:, None, None]
    rows = jnp.arange(b, dtype=jnp.int32)[None, :, None]
    slots = (start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :])[None]  # [1, B, T]
    # Indices (layers, rows, :, slots): the update is [L', B, T, KV, hd].
    return buf.at[layers, rows, :, slots].set(to_storage(new, buf.dtype), mode="drop")


def _write_windows(buf: jax.Array, src: jax.Array, start: jax.Array) -> jax.Array:
    """Row by row: src[i] [KV, T, hd] at slots start[i] + t of buf [B, KV, S, hd], as a T-slot
    window (read first, so slots past S keep their old values), written in place."""
    t = src.shape[2]
    for i in range(buf.shape[0]):
        s0 = jnp.minimum(start[i], buf.shape[2] - t)
        old = jax.lax.dynamic_slice(buf, (i, 0, s0, 0), (1, *src.shape[1:]))
        j = s0 + jnp.arange(t, dtype=jnp.int32) - start[i]  # window slot -> index into src
        win = jnp.take(src[i:i + 1], jnp.clip(j, 0, t - 1), axis=2)
        win = jnp.where(((j >= 0) & (j < t))[None, None, :, None], win, old)
        buf = jax.lax.dynamic_update_slice(buf, win, (i, 0, s0, 0))
    return buf


def _scatter_rows(buf: jax.Array, src: jax.Array, start: jax.Array) -> jax.Array:
    b, _, t, _ = src.shape
    slots = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    # Indices (rows, :, slots): the indexed dims come first, so the update is [B, T, KV, hd].
    return buf.at[rows, :, slots].set(jnp.swapaxes(src, 1, 2), mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer (updated in place by the forward's layer loop): one buffer
    per layer, or, for scanned layers (`ModelConfig.scan_layers`), one stack of all layers.

    Slots `[0, lengths[b])` of row b hold committed tokens; slots beyond are scratch that a
    forward pass may write (drafted tokens under verification) and a later commit may keep.
    """

    # L x dtype[B, KV, S, hd] (head-major), or one dtype[L, B, KV, S, hd] (scanned layers: a
    # leaf with one more dimension than its declared axes is a stack, `jspec.sharding`)
    k: tuple[jax.Array, ...] | jax.Array = logical(*KV_AXES, stackable=True)
    v: tuple[jax.Array, ...] | jax.Array = logical(*KV_AXES, stackable=True)  # as k
    lengths: jax.Array = logical("batch")  # i32[B] committed slots per row

    @property
    def stacked(self) -> bool:
        """One [L, B, KV, S, hd] buffer per K and V (scanned layers)."""
        return not isinstance(self.k, tuple)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0] if self.stacked else len(self.k)

    @property
    def capacity(self) -> int:
        return (self.k if self.stacked else self.k[0]).shape[-2]

    @property
    def batch(self) -> int:
        return (self.k if self.stacked else self.k[0]).shape[-4]

    @classmethod
    def create(cls, config: ModelConfig, batch: int, capacity: int,
               num_layers: int | None = None) -> KVCache:
        """An empty cache: i32 lengths of zero, zeroed buffers of `capacity` slots, stacked when
        `config.scan_layers`.

        Head-major [B, KV, S, hd]: each (row, KV head) is one contiguous [S, hd] matrix, so the
        score and value products of attention are plain batched GEMMs over the buffer as it
        lies (with [B, S, KV, hd], XLA:CPU transposes the whole buffer in every layer of every
        step: at batch 64 and 256 slots attention took 2.9x longer; docs/BENCHMARKS.md), and a
        Pallas tile of one head's slots is one contiguous block.
        """
        layers = config.num_layers if num_layers is None else num_layers
        shape = (batch, config.num_kv_heads, capacity, config.head_dim)
        dt = storage_dtype(config.jnp_dtype)
        if config.scan_layers:
            k, v = jnp.zeros((layers, *shape), dt), jnp.zeros((layers, *shape), dt)
        else:
            k = tuple(jnp.zeros(shape, dt) for _ in range(layers))
            v = tuple(jnp.zeros(shape, dt) for _ in range(layers))
        return cls(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32))

    def with_lengths(self, lengths: jax.Array) -> KVCache:
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))

    def write(self, new_k: jax.Array, new_v: jax.Array) -> KVCache:
        """The cache with new_k / new_v dtype[L, B, T, KV, hd] (a `forward(...,
        write_cache=False)`'s `new_kv`) written at slots lengths + t of the first L layers."""
        if self.stacked:
            return dataclasses.replace(self, k=write_stack(self.k, new_k, self.lengths),
                                       v=write_stack(self.v, new_v, self.lengths))
        ks = tuple(write_slots(c, n, self.lengths) for c, n in zip(self.k, new_k, strict=False))
        vs = tuple(write_slots(c, n, self.lengths) for c, n in zip(self.v, new_v, strict=False))
        return dataclasses.replace(self, k=ks + self.k[len(ks):], v=vs + self.v[len(vs):])
