"""Tree-verification attention with a shared prefix, as a Mosaic GPU (Hopper) Pallas kernel.

Same contract as `kernel.tree_attention` (the TPU kernel) and `tree_attention_reference`. One CTA
(one warpgroup) per (row, KV head, 64-query tile, prefix split): the tile holds 64 of the T·G query
rows of that KV head (row r = t·G + g, zero-padded to a multiple of 64, the WGMMA M). It

  1. (split 0 only) runs the tree part: S = Q·K_newᵀ on the tensor cores (WGMMA), masked by the
     ancestor relation, exp, and P·V_new into the f32 accumulator; every node sees itself;
  2. walks its split's share of the row's own prefix tiles, `[c·per, min((c+1)·per,
     cdiv(length, block_kv)))` (a dynamic trip count: nothing is read past the last valid tile),
     double-buffered: the TMA copy of tile j+1 is in flight while tile j is multiplied; online
     softmax across tiles. In the last, partial tile the scores past the length are masked and
     the value rows past it are zeroed in shared memory (the cache may hold NaN there, and 0·NaN
     would poison P·V);
  3. writes its f32 partial output and log-sum-exp; a jnp merge over the splits (flash-decoding)
     gives the result. Without the split, one row's 8 KV heads × 1 query tile would occupy 8 of
     132 SMs (measured: slower than XLA at 16k+ prefixes).

The ancestor relation: node t's ancestor set is a 64-bit word (two i32) built from the parent
indices by pointer doubling over [B, T] words in the wrapper (O(B·T) integers, not a [T, T] or
per-head mask); the kernel reads the word of each of its 64 query rows and tests bit u for node u.

Limits (checked at trace time, with a clear error): bfloat16 or float16 inputs (the WGMMA operand
types), head_dim 64 or 128 (shared memory),
T ≤ 64 nodes, S a multiple of block_kv. Scores, softmax and accumulation are float32; P is cast
to the input dtype for P·V (as the reference does).

Only `jax.experimental.pallas` and `jax.experimental.pallas.mosaic_gpu` are used (no Triton, no
`jax._src`). It lowers on any machine (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`
is tested on CPU); it runs only on a Hopper GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mgpu_compat import load

# A large finite negative instead of -inf: a fully masked tile stays finite (exp gives 0, no
# NaN). Shared with the TPU kernel and the reference (`kernel.py` imports it from here).
MASK_VALUE = -1e30
BLOCK_Q = 64  # query rows per CTA: the WGMMA M of one warpgroup
MAX_NODES = 64  # the ancestor set of a node is one 64-bit word (two i32)


def ancestor_words(parents: jax.Array, num_nodes: int) -> tuple[jax.Array, jax.Array]:
    """(lo, hi) i32[B, T]: bit u of node t's word is set iff u is t or an ancestor of t.

    lo holds nodes 0..31, hi nodes 32..63. parents: i32[B, T], -1 for a root. Pointer doubling:
    after step k, `jump` is the 2^k-th ancestor and `words` covers all ancestors up to 2^k - 1
    levels up, so ceil(log2 T) + 1 steps cover every depth.
    """
    b = parents.shape[0]
    node = jnp.arange(num_nodes, dtype=jnp.int32)

    def bit(u):  # (lo, hi) words with bit u set (u < 0: none)
        lo = jnp.where((u >= 0) & (u < 32), jnp.left_shift(1, jnp.clip(u, 0, 31)), 0)
        hi = jnp.where(u >= 32, jnp.left_shift(1, jnp.clip(u - 32, 0, 31)), 0)
        return lo.astype(jnp.int32), hi.astype(jnp.int32)

    lo, hi = bit(jnp.broadcast_to(node, (b, num_nodes)))
    jump = parents
    for _ in range(max(1, math.ceil(math.log2(max(num_nodes, 2)))) + 1):
        safe = jnp.maximum(jump, 0)
        has = jump >= 0
        lo = lo | jnp.where(has, jnp.take_along_axis(lo, safe, axis=1), 0)
        hi = hi | jnp.where(has, jnp.take_along_axis(hi, safe, axis=1), 0)
        jump = jnp.where(has, jnp.take_along_axis(jump, safe, axis=1), -1)
    return lo, hi


def check_mgpu_inputs(q: jax.Array, block_kv: int, s: int) -> None:
    """Trace-time limits of the GPU kernel (beyond the shared `_check_inputs`)."""
    _, t, _, hd = q.shape
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"the Mosaic GPU tree-attention kernel takes bfloat16 or float16, got "
                         f"{q.dtype} (use tree_attention_reference, or cast)")
    if hd not in (64, 128):
        raise ValueError(f"the Mosaic GPU kernel takes head_dim 64 or 128, got {hd}")
    if t > MAX_NODES:
        raise ValueError(f"the Mosaic GPU kernel takes at most {MAX_NODES} tree nodes, got {t}")
    if block_kv % 64 or s % block_kv:
        raise ValueError(f"block_kv ({block_kv}) must be a multiple of 64 and divide S ({s})")


def gpu_kernel_supports(num_nodes: int, head_dim: int, capacity: int, dtype) -> bool:
    """Whether `check_mgpu_inputs` would accept these static shapes (for "auto" dispatch)."""
    return (jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim in (64, 128)
            and num_nodes <= MAX_NODES and capacity % 64 == 0)


def default_splits(ctas: int, num_tiles: int, target_ctas: int = 132) -> int:
    """Prefix splits per (row, KV head, query tile): about one CTA per SM of an H100/H200 in all,
    and at least two prefix tiles per split. Measured on an H200 (docs/BENCHMARKS.md, the
    `--sweep` of `python -m pallas_kernels.bench`): at T=64 and a 32k prefix, 4 splits (128
    CTAs) took 0.122 ms, 9 (288 CTAs) 0.158 ms and 1 split 0.40 ms; at T=16, 16 splits (128
    CTAs) 0.063 ms and 33 splits 0.065 ms."""
    return max(1, min(-(-target_ctas // ctas), -(-num_tiles // 2)))


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_kv", "num_splits"))
def tree_attention_mgpu(
    q: jax.Array,  # bf16|f16[B, T, H, hd]
    k_cache: jax.Array,  # [B, KV, S, hd]
    v_cache: jax.Array,  # [B, KV, S, hd]
    lengths: jax.Array,  # i32[B]
    k_new: jax.Array,  # [B, T, KV, hd]
    v_new: jax.Array,  # [B, T, KV, hd]
    parents: jax.Array,  # i32[B, T]
    *,
    sm_scale: float,
    block_kv: int,
    num_splits: int | None = None,
) -> jax.Array:  # [B, T, H, hd]
    """The Mosaic GPU kernel; call it through `tree_attention` (validation, defaults).

    num_splits: static; the prefix tiles of each (row, KV head, query tile) are split over this
    many CTAs (flash-decoding: a handful of query tiles alone would leave most SMs idle), each
    writing its f32 partial output and log-sum-exp, merged in jnp. Default `default_splits`.
    """
    b, t, h, hd = q.shape
    kv, s = k_cache.shape[1], k_cache.shape[2]
    g = h // kv
    check_mgpu_inputs(q, block_kv, s)
    dt = q.dtype
    rows = t * g
    rp = pl.cdiv(rows, BLOCK_Q) * BLOCK_Q
    nq = rp // BLOCK_Q
    tp = BLOCK_Q  # tree nodes padded to 64: the N of S_tree and the K of P_tree·V_new
    bk = block_kv
    num_tiles = s // bk
    splits = default_splits(b * kv * nq, num_tiles) if num_splits is None else int(num_splits)
    if not 1 <= splits <= num_tiles:
        raise ValueError(f"num_splits must be in [1, {num_tiles}], got {splits}")
    per = -(-num_tiles // splits)  # prefix tiles per split

    # Small regroupings (T nodes, not the cache): queries as [B, KV, Rp, hd], node K/V as
    # [B, KV, 64, hd], and each query row's ancestor word [B, Rp].
    qg = q.reshape(b, t, kv, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, kv, rows, hd)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rp - rows), (0, 0)))
    kn = jnp.pad(k_new.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, tp - t), (0, 0)))
    vn = jnp.pad(v_new.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, tp - t), (0, 0)))
    lo, hi = ancestor_words(parents, t)
    row_node = jnp.arange(rp) // g
    lo_rows = jnp.where(jnp.arange(rp) < rows, lo[:, jnp.minimum(row_node, t - 1)], 0)
    hi_rows = jnp.where(jnp.arange(rp) < rows, hi[:, jnp.minimum(row_node, t - 1)], 0)
    lengths = lengths.astype(jnp.int32)

    def smem_transforms(dtype):
        itemsize = jnp.dtype(dtype).itemsize
        return (plgpu.TilingTransform((8, 128 // itemsize)), plgpu.SwizzleTransform(128))

    transforms = smem_transforms(dt)
    inv_ln2 = 1.0 / math.log(2.0)
    scale2 = sm_scale * inv_ln2  # scores kept in the log2 domain: exp2 instead of exp
    wgmma_layout = plgpu.Layout.WGMMA

    def body(len_gmem, lo_gmem, hi_gmem, q_gmem, kc_gmem, vc_gmem, kn_gmem, vn_gmem, o_gmem,
             lse_gmem, q_smem, kn_smem, vn_smem, k_smem, v_smem, o_smem, lo_smem, hi_smem,
             lse_smem, in_bar, k_bar, v_bar):
        bi = lax.axis_index("b")
        hi_ = lax.axis_index("kvh")
        qi = lax.axis_index("qt")
        c = lax.axis_index("split")
        length = len_gmem[bi]
        ntiles = lax.div(length + (bk - 1), jnp.int32(bk))
        first = c * per
        end = jnp.minimum(first + per, ntiles)  # this split's tiles: [first, end)

        def fetch(j, slot):
            src = (bi, hi_, pl.ds(j * bk, bk))  # a contiguous (bk, hd) tile
            plgpu.copy_gmem_to_smem(kc_gmem.at[src], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(vc_gmem.at[src], v_smem.at[slot], v_bar.at[slot])

        rsl = pl.ds(qi * BLOCK_Q, BLOCK_Q)
        plgpu.copy_gmem_to_smem(q_gmem.at[bi, hi_, rsl], q_smem, in_bar.at[0])
        plgpu.copy_gmem_to_smem(kn_gmem.at[bi, hi_], kn_smem, in_bar.at[1])
        plgpu.copy_gmem_to_smem(vn_gmem.at[bi, hi_], vn_smem, in_bar.at[2])
        plgpu.copy_gmem_to_smem(lo_gmem.at[bi, rsl], lo_smem, in_bar.at[3])
        plgpu.copy_gmem_to_smem(hi_gmem.at[bi, rsl], hi_smem, in_bar.at[4])

        @pl.when(first < end)
        def _():
            fetch(first, 0)

        for i in range(5):
            plgpu.barrier_wait(in_bar.at[i])

        # 1. The tree part (split 0 only: the other splits mask it out entirely).
        def tree_scores(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, kn_smem.transpose((1, 0)))
            return acc_ref[...]

        st = pl.run_scoped(tree_scores, plgpu.ACC((BLOCK_Q, tp), jnp.float32)) * scale2
        red = wgmma_layout.reduce(1)
        w_lo = lax.broadcast_in_dim(load(lo_smem, (), layout=red, optimized=False),
                                    (BLOCK_Q, tp), [0])
        w_hi = lax.broadcast_in_dim(load(hi_smem, (), layout=red, optimized=False),
                                    (BLOCK_Q, tp), [0])
        col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, tp), 1, layout=wgmma_layout)
        word = jnp.where(col < 32, w_lo, w_hi)
        visible = ((lax.shift_right_logical(word, col & 31) & 1) != 0) & (c == 0)
        st = jnp.where(visible, st, MASK_VALUE)
        m = st.max(axis=1)
        # Explicit zeros where masked: a row that sees nothing here (a padded query row, or any
        # row in splits > 0) must contribute nothing, not exp2(MASK - MASK) = 1.
        p = jnp.where(visible, jnp.exp2(st - lax.broadcast_in_dim(m, st.shape, [0])), 0.0)
        l_sum = p.sum(axis=1)
        acc = plgpu.layout_cast(jnp.zeros((BLOCK_Q, hd), jnp.float32), wgmma_layout)

        def tree_pv(acc_ref):
            plgpu.wgmma(acc_ref, p.astype(dt), vn_smem)

        acc = pl.run_state(tree_pv)(plgpu.ACC.init(acc))

        # 2. This split's prefix tiles (double-buffered TMA).
        def step(j, carry):
            acc, m, l_sum = carry
            slot = lax.rem(j - first, 2)

            @pl.when(j + 1 < end)
            def _():
                fetch(j + 1, 1 - slot)

            plgpu.barrier_wait(k_bar.at[slot])

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            sc = pl.run_scoped(scores, plgpu.ACC((BLOCK_Q, bk), jnp.float32)) * scale2
            kcol = j * bk + plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, bk), 1,
                                                   layout=wgmma_layout)
            sc = jnp.where(kcol < length, sc, MASK_VALUE)
            m_new = jnp.maximum(m, sc.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, sc.shape, [0]))
            l_sum = l_sum * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_bar.at[slot])

            @pl.when((j + 1) * bk > length)
            def _zero_tail():  # value rows past the length may be NaN: zero them
                v = v_smem.at[slot][...]
                vrow = j * bk + plgpu.broadcasted_iota(jnp.int32, (bk, hd), 0,
                                                       layout=wgmma_layout)
                v_smem.at[slot][...] = jnp.where(vrow < length, v, jnp.zeros_like(v))
                plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p.astype(dt), v_smem.at[slot])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            return acc, m_new, l_sum

        acc, m, l_sum = lax.fori_loop(first, jnp.maximum(first, end), step, (acc, m, l_sum))
        seen = l_sum > 0
        out = acc / lax.broadcast_in_dim(jnp.where(seen, l_sum, 1.0), acc.shape, [0])
        o_smem[...] = out
        lse_smem[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l_sum, 1.0)) * inv_ln2,
                                  MASK_VALUE)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[bi, hi_, c, rsl])
        plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[bi, hi_, c, rsl])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((b, kv, splits, rp, hd), jnp.float32),
                  jax.ShapeDtypeStruct((b, kv, splits, rp), jnp.float32)),
        scratch_types=[
            plgpu.SMEM((BLOCK_Q, hd), dt, transforms=transforms),
            plgpu.SMEM((tp, hd), dt, transforms=transforms),
            plgpu.SMEM((tp, hd), dt, transforms=transforms),
            plgpu.SMEM((2, bk, hd), dt, transforms=transforms),
            plgpu.SMEM((2, bk, hd), dt, transforms=transforms),
            plgpu.SMEM((BLOCK_Q, hd), jnp.float32, transforms=smem_transforms(jnp.float32)),
            plgpu.SMEM((BLOCK_Q,), jnp.int32),
            plgpu.SMEM((BLOCK_Q,), jnp.int32),
            plgpu.SMEM((BLOCK_Q,), jnp.float32),
            plgpu.Barrier(num_barriers=5),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_barriers=2),
        ],
        grid=(b, kv, nq, splits),
        grid_names=("b", "kvh", "qt", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    o_part, lse = kernel(lengths, lo_rows, hi_rows, qg, k_cache, v_cache, kn, vn)
    # Merge the splits (log2-domain log-sum-exp): O(B·KV·splits·Rp·hd), no cache-sized array.
    top = jnp.max(lse, axis=2, keepdims=True)
    wts = jnp.exp2(lse - top)  # [B, KV, splits, Rp]
    out = jnp.sum(wts[..., None] * o_part, axis=2) / jnp.sum(wts, axis=2)[..., None]
    out = out[:, :, :rows].astype(dt).reshape(b, kv, t, g, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, h, hd)
