"""Fused relaxed acceptance over vocabulary tiles, as Mosaic GPU Pallas kernels (Hopper).

Same contract and result as `kernel.relaxed_acceptance` (the TPU kernel) and the jnp reference;
the math is stated in `kernel.py`. The GPU layout differs because one batch row is far too little
work for one CTA of a 132-SM chip: the vocabulary of each row is split over `num_splits` CTAs
(split-K), each streaming its share in tiles of `block_v` entries straight from global memory into
registers (one warpgroup, `WG_STRIDED` layout, no shared-memory staging: each element is read
once). Each CTA writes a handful of partial statistics per drafted position; a few O(B·splits·K)
jnp ops merge them (max / rescaled sums / first argmax). Passes:

  1. stats (every call): per position i ≤ K, the running max and sum of exp(z_i / T) and the
     first argmax of z_i. Merged, with z_i(x_i) and q_i(x_i) (O(B·K) gathers) → acceptance, n,
     log-normaliser of position n.
  2. ν-argmax (greedy with a weight w only): per position i < K the first argmax of
     ν_i = w·p_i + (1 - w)·q_i (needs the merged normalisers of pass 1).
  3. residual (sampling only): on position n alone (a per-row dynamic row of the logits), the
     Gumbel-max over [p_n - q_n]_+ and over p_n, and the residual mass.

No [B, K+1, V] probability array is ever written. A tile that overhangs the vocabulary is read
shifted back to end at V (so no read is out of bounds), and the entries it repeats are masked.

Only `jax.experimental.pallas` and `jax.experimental.pallas.mosaic_gpu` are used (no Triton, no
`jax._src`). It lowers on any machine (tested on CPU with `lowering_platforms=("cuda",)`); it runs
only on a GPU with Mosaic GPU support (Hopper).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mgpu_compat import load
from pallas_kernels.relaxed_acceptance.decide import (
    BIG_INDEX,
    MASK_VALUE,
    RESIDUAL_EPS,
    decide_greedy,
    decide_sampled,
)

_BIG = BIG_INDEX
_PAD = 4  # partial-statistic rows are padded to 16 bytes (TMA stride rule)


def _pad4(n: int) -> int:
    return -(-n // _PAD) * _PAD


def default_splits(batch: int, num_tiles: int, target_ctas: int = 264) -> int:
    """Vocabulary splits per row: about two CTAs per SM of an H100/H200 in all, ≥ 1 tile each."""
    return max(1, min(num_tiles, -(-target_ctas // batch)))


def _tiles(v: int, tv: int, splits: int):
    """(tiles per split, layout) for a [tv] tile; tiles of split c cover [c·per·tv, ...)."""
    nv = -(-v // tv)
    per = -(-nv // splits)
    layout = plgpu.Layout.WG_STRIDED((tv,), vec_size=4)
    return per, layout


def _load_tile(row_ref, start, v: int, tv: int, layout):
    """(f32[tv] values, i32[tv] columns, bool[tv] in range) of the tile starting at `start`."""
    ls = jnp.minimum(start, v - tv)  # an overhanging tile is read shifted back to end at V
    x = load(row_ref, pl.ds(ls, tv), layout=layout, optimized=False).astype(jnp.float32)
    col = ls + plgpu.broadcasted_iota(jnp.int32, (tv,), 0, layout=layout)
    ok = (col >= start) & (col < v)
    return x, col, ok


def _first_argmax(x, col):
    mx = x.max()
    return mx, jnp.where(x == mx, col, _BIG).min()


def _stats_call(z, *, temperature: float, tv: int, splits: int):
    """Per (row, split, position): f32[B, S, 2, K1p] (max, sum of exp(z - max)), i32[B, S, K1p]
    first argmax. (z(x_i) and q(x_i) are O(B·K) gathers, done outside the kernel.)"""
    b, k1, v = z.shape
    kp = _pad4(k1)
    per, layout = _tiles(v, tv, splits)

    def body(z_gmem, st_gmem, ix_gmem, st_smem, ix_smem):
        bi = lax.axis_index("b")
        c = lax.axis_index("c")
        base = c * (per * tv)
        for i in range(k1):
            def tile(j, carry, i=i):
                m, l_sum, idx = carry
                start = base + j * tv
                zt, col, ok = _load_tile(z_gmem.at[bi, i], start, v, tv, layout)
                if temperature > 0:
                    zt = zt * (1.0 / temperature)
                zt = jnp.where(ok, zt, MASK_VALUE)
                mx, ix = _first_argmax(zt, col)
                m_new = jnp.maximum(m, mx)
                l_sum = l_sum * jnp.exp(m - m_new) + jnp.exp(zt - m_new).sum()
                idx = jnp.where(mx > m, ix, idx)  # strict: earlier tiles win ties
                return m_new, l_sum, idx

            init = (jnp.float32(MASK_VALUE), jnp.float32(0.0), jnp.int32(0))
            m, l_sum, idx = lax.fori_loop(0, per, tile, init)
            st_smem[0, i] = m
            st_smem[1, i] = l_sum
            ix_smem[i] = idx
        for i in range(k1, kp):
            st_smem[0, i] = jnp.float32(MASK_VALUE)
            st_smem[1, i] = jnp.float32(0.0)
            ix_smem[i] = jnp.int32(0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(st_smem, st_gmem.at[bi, c])
        plgpu.copy_smem_to_gmem(ix_smem, ix_gmem.at[bi, c])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((b, splits, 2, kp), jnp.float32),
                  jax.ShapeDtypeStruct((b, splits, kp), jnp.int32)),
        scratch_types=[plgpu.SMEM((2, kp), jnp.float32), plgpu.SMEM((kp,), jnp.int32)],
        grid=(b, splits), grid_names=("b", "c"))
    return kernel(z)


def _nu_argmax_call(z, q, x, valid, w, lse, *, tv: int, splits: int):
    """Greedy with a weight: per (row, split, position < K) max of ν and its first index."""
    b, k1, v = z.shape
    k = k1 - 1
    kp = _pad4(k)
    per, layout = _tiles(v, tv, splits)
    one_hot = q is None

    def body(z_gmem, *refs):
        if one_hot:
            x_gmem, ok_gmem, w_gmem, lse_gmem, mx_gmem, ix_gmem, mx_smem, ix_smem = refs
            q_gmem = None
        else:
            (q_gmem, x_gmem, ok_gmem, w_gmem, lse_gmem, mx_gmem, ix_gmem, mx_smem,
             ix_smem) = refs
        bi = lax.axis_index("b")
        c = lax.axis_index("c")
        base = c * (per * tv)
        wv = w_gmem[bi]
        for i in range(k):
            xi, oki, lse_i = x_gmem[bi, i], ok_gmem[bi, i], lse_gmem[bi, i]

            def tile(j, carry, i=i, xi=xi, oki=oki, lse_i=lse_i):
                best, idx = carry
                start = base + j * tv
                zt, col, ok = _load_tile(z_gmem.at[bi, i], start, v, tv, layout)
                if one_hot:
                    qt = jnp.where(col == xi, 1.0, 0.0)
                else:
                    qt, _, _ = _load_tile(q_gmem.at[bi, i], start, v, tv, layout)
                qt = qt * oki.astype(jnp.float32)
                nu = wv * jnp.exp(zt - lse_i) + (1.0 - wv) * qt
                nu = jnp.where(ok, nu, -1.0)
                mx, ix = _first_argmax(nu, col)
                better = mx > best
                return jnp.where(better, mx, best), jnp.where(better, ix, idx)

            best, idx = lax.fori_loop(0, per, tile, (jnp.float32(-1.0), jnp.int32(0)))
            mx_smem[i] = best
            ix_smem[i] = idx
        for i in range(k, kp):
            mx_smem[i] = jnp.float32(-1.0)
            ix_smem[i] = jnp.int32(0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(mx_smem, mx_gmem.at[bi, c])
        plgpu.copy_smem_to_gmem(ix_smem, ix_gmem.at[bi, c])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((b, splits, kp), jnp.float32),
                  jax.ShapeDtypeStruct((b, splits, kp), jnp.int32)),
        scratch_types=[plgpu.SMEM((kp,), jnp.float32), plgpu.SMEM((kp,), jnp.int32)],
        grid=(b, splits), grid_names=("b", "c"))
    args = (x, valid, w, lse) if one_hot else (q, x, valid, w, lse)
    return kernel(z, *args)


def _residual_call(z, q, sel, lse_n, gumbel, *, temperature: float, tv: int, splits: int):
    """Sampling: per (row, split) over position n: f32[B, S, 4] (best_r, best_p, mass, 0) and
    i32[B, S, 4] (idx_r, idx_p, 0, 0). sel: i32[B, 4] = (n, min(n, K-1), proposed, x_n)."""
    b, _, v = z.shape
    per, layout = _tiles(v, tv, splits)
    one_hot = q is None

    def body(z_gmem, *refs):
        if one_hot:
            sel_gmem, lse_gmem, g_gmem, f_gmem, i_gmem, f_smem, i_smem = refs
            q_gmem = None
        else:
            q_gmem, sel_gmem, lse_gmem, g_gmem, f_gmem, i_gmem, f_smem, i_smem = refs
        bi = lax.axis_index("b")
        c = lax.axis_index("c")
        base = c * (per * tv)
        n, qn = sel_gmem[bi, 0], sel_gmem[bi, 1]
        proposed, xn = sel_gmem[bi, 2] > 0, sel_gmem[bi, 3]
        lse = lse_gmem[bi]

        def tile(j, carry):
            best_r, idx_r, best_p, idx_p, mass = carry
            start = base + j * tv
            zt, col, ok = _load_tile(z_gmem.at[bi, n], start, v, tv, layout)
            logp = jnp.where(ok, zt * (1.0 / temperature) - lse, MASK_VALUE)
            p = jnp.exp(logp)
            if one_hot:
                qt = jnp.where(col == xn, 1.0, 0.0)
            else:
                qt, _, _ = _load_tile(q_gmem.at[bi, qn], start, v, tv, layout)
            qt = jnp.where(ok & proposed, qt, 0.0)
            r = jnp.maximum(p - qt, 0.0)
            g, _, _ = _load_tile(g_gmem.at[bi], start, v, tv, layout)
            g = jnp.where(ok, g, 0.0)
            mass = mass + r.sum()
            key_r = jnp.where(r > 0, jnp.log(jnp.where(r > 0, r, 1.0)) + g, MASK_VALUE)
            key_p = jnp.where(ok, logp + g, MASK_VALUE)
            mr, ir = _first_argmax(key_r, col)
            mp, ip = _first_argmax(key_p, col)
            return (jnp.where(mr > best_r, mr, best_r), jnp.where(mr > best_r, ir, idx_r),
                    jnp.where(mp > best_p, mp, best_p), jnp.where(mp > best_p, ip, idx_p), mass)

        init = (jnp.float32(MASK_VALUE), jnp.int32(0), jnp.float32(MASK_VALUE), jnp.int32(0),
                jnp.float32(0.0))
        best_r, idx_r, best_p, idx_p, mass = lax.fori_loop(0, per, tile, init)
        f_smem[0] = best_r
        f_smem[1] = best_p
        f_smem[2] = mass
        f_smem[3] = jnp.float32(0.0)
        i_smem[0] = idx_r
        i_smem[1] = idx_p
        i_smem[2] = jnp.int32(0)
        i_smem[3] = jnp.int32(0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(f_smem, f_gmem.at[bi, c])
        plgpu.copy_smem_to_gmem(i_smem, i_gmem.at[bi, c])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((b, splits, 4), jnp.float32),
                  jax.ShapeDtypeStruct((b, splits, 4), jnp.int32)),
        scratch_types=[plgpu.SMEM((4,), jnp.float32), plgpu.SMEM((4,), jnp.int32)],
        grid=(b, splits), grid_names=("b", "c"))
    args = (sel, lse_n, gumbel) if one_hot else (q, sel, lse_n, gumbel)
    return kernel(z, *args)


def _merge_argmax(mx: jax.Array, idx: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Max over splits (axis 1) and the first index attaining it (splits are in vocab order)."""
    best = jnp.max(mx, axis=1)
    first = jnp.min(jnp.where(mx == best[:, None], idx, _BIG), axis=1)
    return best, first


@functools.partial(jax.jit, static_argnames=("temperature", "block_v", "num_splits", "weighted"))
def relaxed_acceptance_mgpu(
    target_logits: jax.Array,  # f32|bf16[B, K+1, V]
    x: jax.Array,  # i32[B, K]
    q: jax.Array | None,  # f32[B, K, V] | None (one-hot)
    ok: jax.Array,  # i32[B, K]: 1 where drafted
    u: jax.Array,  # f32[B, K]
    wv: jax.Array,  # f32[B]
    gumbel: jax.Array | None,  # f32[B, V] (sampling)
    *,
    temperature: float,
    block_v: int,
    num_splits: int | None,
    weighted: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # n i32[B], token i32[B], prob f32[B, K]
    """The Mosaic GPU passes and their merges; call through `relaxed_acceptance`."""
    b, k1, v = target_logits.shape
    k = k1 - 1
    tv = int(block_v)
    if tv % 512 or tv > v:
        raise ValueError(f"block_v ({tv}) must be a multiple of 512 and at most V ({v})")
    nv = -(-v // tv)
    splits = default_splits(b, nv) if num_splits is None else int(num_splits)
    if not 1 <= splits <= nv:
        raise ValueError(f"num_splits must be in [1, {nv}], got {splits}")
    greedy = temperature == 0
    st, ix = _stats_call(target_logits, temperature=float(temperature), tv=tv, splits=splits)
    st, ix = st[..., :k1], ix[..., :k1]
    m_s, l_s = st[:, :, 0], st[:, :, 1]  # [B, S, K1]
    m = jnp.max(m_s, axis=1)  # [B, K1]
    lse = m + jnp.log(jnp.sum(l_s * jnp.exp(m_s - m[:, None]), axis=1))
    _, target_tok = _merge_argmax(m_s, ix)  # [B, K1]
    # z_i(x_i) and q_i(x_i): O(B·K) gathers.
    zx = jnp.take_along_axis(target_logits[:, :k], x[..., None], axis=-1)[..., 0]
    zx = zx.astype(jnp.float32) / (temperature if temperature > 0 else 1.0)
    qx = (jnp.ones((b, k), jnp.float32) if q is None
          else jnp.take_along_axis(q, x[..., None], axis=-1)[..., 0].astype(jnp.float32))
    valid = ok > 0
    rows = jnp.arange(b)
    if greedy:
        if weighted:
            lse_p = jnp.pad(lse[:, :k], ((0, 0), (0, _pad4(k) - k)))
            mx, nix = _nu_argmax_call(target_logits, q, x, ok, wv, lse_p, tv=tv, splits=splits)
            _, choice = _merge_argmax(mx[..., :k], nix[..., :k])
        else:
            choice = target_tok[:, :k]
        return decide_greedy(x, valid, target_tok, choice, weighted)
    n, row, proposed, prob = decide_sampled(x, valid, zx, qx, lse[:, :k], u, wv)
    sel = jnp.stack([n, row, proposed.astype(jnp.int32), x[rows, row]], axis=1)
    lse_n = lse[rows, n]
    f, i = _residual_call(target_logits, q, sel, lse_n, gumbel.astype(jnp.float32),
                          temperature=float(temperature), tv=tv, splits=splits)
    _, idx_r = _merge_argmax(f[:, :, 0], i[:, :, 0])
    _, idx_p = _merge_argmax(f[:, :, 1], i[:, :, 1])
    mass = jnp.sum(f[:, :, 2], axis=1)
    tok = jnp.where(mass > RESIDUAL_EPS, idx_r, idx_p)
    return n, tok.astype(jnp.int32), prob
