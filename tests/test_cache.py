"""The KV cache's writes (jspec.models.cache): write_slots and path_kv against numpy, the
capacity edge included; embedding rows equal a take."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models.cache import from_storage, storage_dtype, to_storage, write_slots


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("t", [1, 4, 20])
def test_write_slots_matches_numpy_including_the_capacity_edge(dtype, batch, t):
    """Both write paths (one row's window, the scatter) write new[b, i] at slot start[b] + i
    and drop slots past the capacity (never wrap or clamp), on a buffer in its storage dtype
    (bfloat16 as uint16 bits; reading back gives exactly the values cast to bfloat16)."""
    assert storage_dtype(dtype) == (jnp.uint16 if dtype == jnp.bfloat16 else dtype)

    s, kv, hd = (8 if t < 8 else 24), 2, 3
    rng = np.random.default_rng(0)
    buf = rng.normal(size=(batch, kv, s, hd)).astype(np.float32)
    new = rng.normal(size=(batch, t, kv, hd)).astype(np.float32)
    for starts in ([0] * batch, [s - t] * batch, [s - 2] * batch, [s] * batch,
                   list(range(batch)), [s - 1 - b for b in range(batch)]):
        want = buf.copy()
        for b, st in enumerate(starts):
            for i in range(t):
                if st + i < s:
                    want[b, :, st + i] = new[b, i]
        stored = to_storage(jnp.asarray(buf, dtype), storage_dtype(dtype))
        got = jax.jit(write_slots)(stored, jnp.asarray(new, dtype), jnp.asarray(starts, jnp.int32))
        assert got.dtype == storage_dtype(dtype)
        got = from_storage(got, dtype)
        want = np.asarray(jnp.asarray(want, dtype).astype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want, err_msg=str(starts))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
def test_path_kv_writes_the_path_slots_exactly(dtype, batch):
    """A tree's accepted path (node t's K/V at index t of a verify's new K/V) is written at
    start + depth, bit for bit, in the buffer's storage dtype (a uint16 slot holds the bits,
    not a conversion); the slots before start keep theirs."""
    from jspec.models.cache import KVCache
    from jspec.topology import path_kv

    s, kv, hd, layers, t = 12, 2, 3, 2, 7
    rng = np.random.default_rng(1)
    old = [rng.normal(size=(batch, kv, s, hd)).astype(np.float32) for _ in range(2 * layers)]
    bufs = [to_storage(jnp.asarray(v, dtype), storage_dtype(dtype)) for v in old]
    start = np.array([2, 0, 5][:batch], np.int32)
    cache = KVCache(k=tuple(bufs[:layers]), v=tuple(bufs[layers:]),
                    lengths=jnp.asarray(start))
    new = [jnp.asarray(rng.normal(size=(layers, batch, t, kv, hd)), dtype) for _ in range(2)]
    path = np.array([[0, 2, 5, 6], [0, 1, 3, 4], [0, 3, 4, 6]][:batch], np.int32)
    got = jax.jit(lambda c, n, p: c.write(*path_kv(n, p)))(cache, tuple(new), jnp.asarray(path))
    for i, buf in enumerate(got.k + got.v):
        assert buf.dtype == storage_dtype(dtype)
        want = np.array(jnp.asarray(old[i], dtype).astype(jnp.float32))
        src = np.asarray(new[i // layers][i % layers].astype(jnp.float32))  # [B, T, KV, hd]
        for b in range(batch):
            for d in range(path.shape[1]):
                want[b, :, start[b] + d] = src[b, path[b, d]]
        np.testing.assert_array_equal(np.asarray(from_storage(buf, jnp.float32)), want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_embed_rows_equals_take(dtype):
    """`embed_rows` (a 16-bit table gathered as its integer bits) returns exactly the rows of
    `jnp.take`, in the table's dtype or the one asked for, for ids of any shape."""
    from jspec.models.blocks import embed_rows

    table = jnp.asarray(np.random.default_rng(0).standard_normal((50, 8)), dtype)
    ids = jnp.asarray([[3, 0, 49], [7, 7, 1]], jnp.int32)
    got = jax.jit(embed_rows)(table, ids)
    assert got.dtype == table.dtype and got.shape == (2, 3, 8)
    assert np.array_equal(np.asarray(got, np.float32), np.asarray(jnp.take(table, ids, axis=0),
                                                                  np.float32))
    f = jax.jit(embed_rows, static_argnums=2)(table, ids, jnp.float32)
    assert f.dtype == jnp.float32
    assert np.array_equal(np.asarray(f), np.asarray(table, np.float32)[np.asarray(ids)])
