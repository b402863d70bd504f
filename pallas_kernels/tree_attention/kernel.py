"""Tree-verification attention with a shared prefix (cascade form), as a Pallas kernel.

One verification step attends T draft nodes per row (a chain is the special case of a tree)
to (a) the row's committed prefix, slots `[0, lengths[b])` of the KV cache, and (b) the T nodes
themselves, where node t sees exactly its ancestors and itself (the tree is given as parent
indices). The kernel is the cascade form: for each (row, KV head) it walks the prefix in tiles
of `block_kv` slots and multiplies every tile once by all T·G queries of that KV head (the
prefix is shared by every node and every head of the GQA group), and merges the tree part by
log-sum-exp through an online softmax. The ancestor mask is built inside the kernel from the
parent indices (pointer doubling with small matmuls), once per (row, KV head): no dense
[B, H, T, S] mask ever exists.

Backends: this file's kernel is written for TPU (Mosaic): scalar prefetch of the lengths through
`pltpu.PrefetchScalarGridSpec` and BlockSpecs whose last two dims are (tile, head_dim), so a
head_dim that is a multiple of 128 (or a single KV head) lowers. On CPU it runs with
`interpret=True` (what the tests run). On a GPU, `tree_attention` calls the Mosaic GPU kernel
of `kernel_mgpu.py` instead (WGMMA, TMA, one warpgroup per 64 query rows; bfloat16/float16).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._platform import dispatch
from pallas_kernels.tree_attention.kernel_mgpu import MASK_VALUE, tree_attention_mgpu
from pallas_kernels.tree_attention.tuned_block_sizes import pick_block_kv, pick_block_kv_gpu


def _ancestor_mask(parents: jax.Array, num_nodes: int) -> jax.Array:
    """bool[T, T] from i32[T, 1] parent indices: anc[t, u] iff u is t or an ancestor of t.

    Pointer doubling: each squaring of the reachability relation doubles the path length it
    covers. Built from iota, compares and f32 matmuls of 0/1 values (exact), all of which lower
    on TPU.
    """
    row = jax.lax.broadcasted_iota(jnp.int32, (num_nodes, num_nodes), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (num_nodes, num_nodes), 1)
    anc = ((col == row) | (col == parents)).astype(jnp.float32)  # parents: [T, 1] broadcast
    for _ in range(max(1, math.ceil(math.log2(max(num_nodes, 2))))):
        reach = jnp.dot(anc, anc, preferred_element_type=jnp.float32)
        anc = jnp.where(reach > 0.5, 1.0, anc)
    return anc > 0.5


def _node_rows(num_nodes: int, group: int) -> jax.Array:
    """f32[T*G, T]: one-hot of the node each query row belongs to (row r = t*G + g)."""
    r = jax.lax.broadcasted_iota(jnp.int32, (num_nodes * group, num_nodes), 0)
    t = jax.lax.broadcasted_iota(jnp.int32, (num_nodes * group, num_nodes), 1)
    return ((r >= t * group) & (r < (t + 1) * group)).astype(jnp.float32)


def _precision(a: jax.Array) -> jax.lax.Precision | None:
    # A bfloat16 product says its precision: under jax_default_matmul_precision="highest" Mosaic
    # would get fp32 contract precision for bfloat16 operands and refuse it ("Bad lhs type").
    return jax.lax.Precision.DEFAULT if a.dtype == jnp.bfloat16 else None


def _nt_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """f32[M, N] = a[M, d] @ b[N, d]^T, accumulated in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(a),
                               preferred_element_type=jnp.float32)


def tree_attention_kernel(
    # Scalar prefetch
    lengths_ref,  # i32[B] (SMEM): committed prefix length of each row
    layer_ref,  # i32[1] (SMEM): the layer of a stacked cache (read by the index maps only)
    # Inputs
    q_ref,  # dtype[T*G, hd]: queries of one row's T nodes for the G heads of one KV head
    k_ref,  # dtype[block_kv, hd]: one prefix tile of this KV head's cached keys
    v_ref,  # dtype[block_kv, hd]: the matching cached values
    k_new_ref,  # dtype[T, hd]: keys of the T nodes
    v_new_ref,  # dtype[T, hd]: values of the T nodes
    parents_ref,  # i32[T, 1]: parent node of each node, -1 for a root (child of the prefix)
    # Outputs
    o_ref,  # dtype[T*G, hd]
    # Scratch
    m_ref,  # f32[T*G, 1]: running max of the scores
    l_ref,  # f32[T*G, 1]: running sum of exp(score - max)
    acc_ref,  # f32[T*G, hd]: running sum of exp(score - max) * value
    *, sm_scale: float, group: int, num_nodes: int, block_kv: int):
    b = pl.program_id(0)
    j = pl.program_id(2)
    length = lengths_ref[b]
    q = q_ref[...]

    # The tree part first: every node sees itself, so the running max starts finite and l > 0
    # even for a row whose prefix is empty.
    @pl.when(j == 0)
    def _tree():
        # In float32: the tree block is small (T nodes), and Mosaic fails to verify a bfloat16
        # product this thin (a decode step: T = 1) on TPU.
        s = _nt_dot(q.astype(jnp.float32), k_new_ref[...].astype(jnp.float32)) * sm_scale  # f32[T*G, T]
        anc = _ancestor_mask(parents_ref[...], num_nodes).astype(jnp.float32)
        visible = jnp.dot(_node_rows(num_nodes, group), anc,
                          preferred_element_type=jnp.float32) > 0.5  # [T*G, T]
        s = jnp.where(visible, s, MASK_VALUE)
        m = jnp.max(s, axis=1, keepdims=True)
        p = jnp.exp(s - m)
        m_ref[...] = m
        l_ref[...] = jnp.sum(p, axis=1, keepdims=True)
        acc_ref[...] = jnp.dot(p, v_new_ref[...].astype(jnp.float32),
                               preferred_element_type=jnp.float32)

    # Tiles wholly beyond the prefix are skipped (and their DMA elided: the index map repeats
    # the last valid tile, see `tree_attention`).
    @pl.when(j * block_kv < length)
    def _prefix():
        slot_row = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        slot_col = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
        # Slots at or beyond the length hold junk (or NaN): mask the scores and zero the values,
        # since 0 * NaN would still poison the accumulator.
        s = _nt_dot(q, k_ref[...]) * sm_scale  # f32[T*G, block_kv]
        s = jnp.where(slot_row < length, s, MASK_VALUE)
        v = jnp.where(slot_col < length, v_ref[...], jnp.zeros_like(v_ref[...]))
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        m_ref[...] = m_new
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v.dtype), v,
                                                      precision=_precision(v),
                                                      preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


def _check_inputs(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
                  k_new: jax.Array, v_new: jax.Array, parents: jax.Array | None,
                  allow_f16: bool = False) -> None:
    """Trace-time validation of shapes and dtypes (values are dynamic and not checked)."""
    if q.ndim != 4 or k_cache.ndim != 4 or k_new.ndim != 4:
        raise ValueError(f"expected q [B, T, H, hd], caches [B, KV, S, hd], new K/V [B, T, KV, hd]; "
                         f"got q {q.shape}, k_cache {k_cache.shape}, k_new {k_new.shape}")
    b, t, h, hd = q.shape
    _, kv, s, hd_k = k_cache.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != b or hd_k != hd:
        raise ValueError(f"k_cache {k_cache.shape} / v_cache {v_cache.shape} do not match q {q.shape}")
    if k_new.shape != (b, t, kv, hd) or v_new.shape != k_new.shape:
        raise ValueError(f"k_new {k_new.shape} / v_new {v_new.shape} must be {(b, t, kv, hd)}")
    if h % kv:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({kv})")
    if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be i32[{b}], got {lengths.dtype}{list(lengths.shape)}")
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new),
                    ("v_new", v_new)):
        if a.dtype not in ((jnp.float32, jnp.bfloat16) + ((jnp.float16,) if allow_f16 else ())):
            raise ValueError(f"{name} must be float32 or bfloat16"
                             f"{' or float16' if allow_f16 else ''}, got {a.dtype}")
    if parents is not None and (parents.shape not in ((t,), (b, t))
                                or not jnp.issubdtype(parents.dtype, jnp.integer)):
        raise ValueError(f"parents must be i32[{t}] or i32[{b}, {t}], got "
                         f"{parents.dtype}{list(parents.shape)}")
    if s < 1 or t < 1:
        raise ValueError(f"need at least one cache slot and one node, got S={s}, T={t}")


def _parents_2d(parents: jax.Array | None, batch: int, num_nodes: int) -> jax.Array:
    """i32[B, T]; None is a chain (node t's parent is t - 1)."""
    if parents is None:
        parents = jnp.arange(num_nodes, dtype=jnp.int32) - 1
    parents = jnp.asarray(parents, jnp.int32)
    return jnp.broadcast_to(parents, (batch, num_nodes))


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_kv", "interpret", "platform"))
def tree_attention(
    q: jax.Array,  # dtype[B, T, H, hd]
    k_cache: jax.Array,  # dtype[B, KV, S, hd]
    v_cache: jax.Array,  # dtype[B, KV, S, hd]
    lengths: jax.Array,  # i32[B]
    k_new: jax.Array,  # dtype[B, T, KV, hd]
    v_new: jax.Array,  # dtype[B, T, KV, hd]
    parents: jax.Array | None = None,  # i32[T] | i32[B, T] | None (chain)
    layer: jax.Array | None = None,  # i32 scalar: the layer of a stacked cache
    *,
    sm_scale: float | None = None,
    block_kv: int | None = None,
    interpret: bool | None = None,
    platform: str | None = None,
) -> jax.Array:  # dtype[B, T, H, hd]
    """Attention of T tree nodes to each row's cached prefix plus their ancestors (Pallas).

    Args:
      q: queries of the T nodes (RoPE applied), H = KV * G heads, head h uses KV head h // G.
      k_cache, v_cache: the KV cache; only slots `[0, lengths[b])` of row b are read (slots
        beyond may hold anything, NaN included). Or a stack of every layer's caches,
        dtype[L, B, KV, S, hd], with `layer` saying which: on TPU the kernel's tiles are read
        from the stack where it lies (a slice of it would be a copy of the layer's cache).
      lengths: committed prefix length per row (0 is allowed: the nodes see only the tree).
      k_new, v_new: keys and values of the T nodes.
      parents: parent of each node (`parents[t] < t`, -1 for a root); None is a chain
        (causal attention among the nodes). Per row or shared by all rows.
      sm_scale: static; score scale, default 1/sqrt(hd).
      block_kv: static tuning knob; prefix slots per tile. Default from the tuning table
        (`tuned_block_sizes.pick_block_kv`); it must divide S.
      interpret: static; run the kernel in Pallas interpret mode. Default: True in a program
        compiled for CPU (the only way a Pallas kernel runs there), False elsewhere. Not
        interpreted on a GPU, the Mosaic GPU kernel (`kernel_mgpu.py`) runs: bfloat16/float16,
        head_dim % 64 == 0, T <= 64, block_kv a multiple of 64 (default `pick_block_kv_gpu`).
      platform: static; "cpu" | "gpu" | "tpu", the platform the calling program is compiled
        for. None: decided when the program is lowered (`lax.platform_dependent`), never
        from the host's default backend.

    Returns:
      The attention output, dtype of q; scores, softmax and accumulation in float32.
    """
    return dispatch(lambda mode: _tree_attention(q, k_cache, v_cache, lengths, k_new, v_new,
                                                 parents, layer, sm_scale, block_kv, mode),
                    interpret, platform)


def _layer_stack(k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array | None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(k, v) as stacks [L, B, KV, S, hd] and the layer index i32[1]: a single layer's cache
    is the stack of one."""
    if k_cache.ndim == 5:
        if layer is None:
            raise ValueError(f"a stacked cache {k_cache.shape} needs the layer index")
        return k_cache, v_cache, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    if layer is not None:
        raise ValueError(f"layer given for a single layer's cache {k_cache.shape}")
    return k_cache[None], v_cache[None], jnp.zeros((1,), jnp.int32)


def _tree_attention(q, k_cache, v_cache, lengths, k_new, v_new, parents, layer, sm_scale,
                    block_kv, mode: str) -> jax.Array:
    """`tree_attention` in one mode ("interpret" | "gpu" | "tpu")."""
    interpret = mode == "interpret"
    on_gpu = mode == "gpu"
    k_cache, v_cache, layer = _layer_stack(k_cache, v_cache, layer)
    one = jax.ShapeDtypeStruct(k_cache.shape[1:], k_cache.dtype)
    _check_inputs(q, one, one, lengths, k_new, v_new, parents, allow_f16=on_gpu)
    b, t, h, hd = q.shape
    kv, s = k_cache.shape[2], k_cache.shape[3]
    g = h // kv
    scale = (1.0 / math.sqrt(hd)) if sm_scale is None else float(sm_scale)
    if on_gpu:  # the GPU kernel reads one layer's buffer (a slice of a stack is a copy there)
        k_cache = jax.lax.dynamic_index_in_dim(k_cache, layer[0], keepdims=False)
        v_cache = jax.lax.dynamic_index_in_dim(v_cache, layer[0], keepdims=False)
        bk = pick_block_kv_gpu(s, hd) if block_kv is None else int(block_kv)
        return tree_attention_mgpu(q, k_cache, v_cache, lengths.astype(jnp.int32), k_new, v_new,
                                   _parents_2d(parents, b, t), sm_scale=scale, block_kv=bk)
    bk = pick_block_kv(s, q.dtype) if block_kv is None else int(block_kv)
    if bk < 1 or s % bk:
        raise ValueError(f"block_kv ({bk}) must divide the cache capacity S ({s})")
    nk = s // bk

    # The cache is head-major: a (tile, hd) block of [B, KV, S, hd] is one head's keys, read
    # contiguously (head_dim, the full last dimension, on the lane axis).
    # New K/V head-major too, [B, KV, T, hd]: a (T, hd) block is then the whole of its last
    # two dimensions, which Mosaic takes for any T and head_dim (a (T, hd) block of
    # [B, T, KV*hd] needs hd % 128 == 0 on TPU).
    kn = k_new.transpose(0, 2, 1, 3)
    vn = v_new.transpose(0, 2, 1, 3)
    # Queries are small (T nodes): regroup them as [B, KV, T*G, hd], row r = t*G + g.
    qg = q.reshape(b, t, kv, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, kv, t * g, hd)
    par = _parents_2d(parents, b, t)[..., None]  # i32[B, T, 1]
    lengths = lengths.astype(jnp.int32)

    def kv_map(bi, hi, ji, lengths_ref, layer_ref):
        # Past the row's last valid tile, repeat it: the pipeline then skips the copy.
        last = jnp.maximum(pl.cdiv(lengths_ref[bi], bk) - 1, 0)
        return layer_ref[0], bi, hi, jnp.minimum(ji, last), 0

    sq = pl.squeezed
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, kv, nk),
        in_specs=[
            pl.BlockSpec((sq, sq, t * g, hd), lambda bi, hi, ji, *_: (bi, hi, 0, 0)),
            pl.BlockSpec((sq, sq, sq, bk, hd), kv_map),
            pl.BlockSpec((sq, sq, sq, bk, hd), kv_map),
            pl.BlockSpec((sq, sq, t, hd), lambda bi, hi, ji, *_: (bi, hi, 0, 0)),
            pl.BlockSpec((sq, sq, t, hd), lambda bi, hi, ji, *_: (bi, hi, 0, 0)),
            pl.BlockSpec((sq, t, 1), lambda bi, hi, ji, *_: (bi, 0, 0)),
        ],
        out_specs=pl.BlockSpec((sq, sq, t * g, hd), lambda bi, hi, ji, *_: (bi, hi, 0, 0)),
        scratch_shapes=[pltpu.VMEM((t * g, 1), jnp.float32),
                        pltpu.VMEM((t * g, 1), jnp.float32),
                        pltpu.VMEM((t * g, hd), jnp.float32)],
    )
    kernel = functools.partial(tree_attention_kernel, sm_scale=scale, group=g, num_nodes=t,
                               block_kv=bk)
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, kv, t * g, hd), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="tree_attention",
    )(lengths, layer, qg, k_cache, v_cache, kn, vn, par)
    return out.reshape(b, kv, t, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, t, h, hd)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_kv", "interpret"))
def tree_attention_reference(
    q: jax.Array,  # dtype[B, T, H, hd]
    k_cache: jax.Array,  # dtype[B, KV, S, hd]
    v_cache: jax.Array,  # dtype[B, KV, S, hd]
    lengths: jax.Array,  # i32[B]
    k_new: jax.Array,  # dtype[B, T, KV, hd]
    v_new: jax.Array,  # dtype[B, T, KV, hd]
    parents: jax.Array | None = None,  # i32[T] | i32[B, T] | None (chain)
    layer: jax.Array | None = None,  # i32 scalar: the layer of a stacked cache
    *,
    sm_scale: float | None = None,
    block_kv: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:  # dtype[B, T, H, hd]
    """Pure-jnp `tree_attention`: same signature, same result; runs on every backend.

    One softmax over [prefix slots ; tree nodes] with a dense mask. `block_kv` and `interpret`
    are accepted (and ignored) so that the two functions are interchangeable.
    """
    del block_kv, interpret
    k_cache, v_cache, layer = _layer_stack(k_cache, v_cache, layer)
    k_cache = jax.lax.dynamic_index_in_dim(k_cache, layer[0], keepdims=False)
    v_cache = jax.lax.dynamic_index_in_dim(v_cache, layer[0], keepdims=False)
    _check_inputs(q, k_cache, v_cache, lengths, k_new, v_new, parents, allow_f16=True)
    b, t, h, hd = q.shape
    kv, s = k_cache.shape[1], k_cache.shape[2]
    g = h // kv
    scale = (1.0 / math.sqrt(hd)) if sm_scale is None else float(sm_scale)
    par = _parents_2d(parents, b, t)
    # anc[b, t, u]: u is t or an ancestor of t (pointer doubling, as in the kernel).
    anc = (jnp.arange(t)[None, None, :] == jnp.arange(t)[None, :, None]) | (
        jnp.arange(t)[None, None, :] == par[:, :, None])
    for _ in range(max(1, math.ceil(math.log2(max(t, 2))))):
        anc = anc | (jnp.einsum("btu,buv->btv", anc.astype(jnp.float32),
                                anc.astype(jnp.float32)) > 0.5)
    in_prefix = jnp.arange(s)[None, :] < lengths[:, None]  # [B, S]
    qg = q.reshape(b, t, kv, g, hd)
    s_pre = jnp.einsum("btkgd,bksd->bkgts", qg, k_cache, preferred_element_type=jnp.float32)
    s_new = jnp.einsum("btkgd,bukd->bkgtu", qg, k_new, preferred_element_type=jnp.float32)
    s_pre = jnp.where(in_prefix[:, None, None, None, :], s_pre * scale, MASK_VALUE)
    s_new = jnp.where(anc[:, None, None, :, :], s_new * scale, MASK_VALUE)
    probs = jax.nn.softmax(jnp.concatenate([s_pre, s_new], axis=-1), axis=-1)
    vc = jnp.where(in_prefix[:, None, :, None], v_cache, jnp.zeros_like(v_cache))
    vals = jnp.concatenate([jnp.swapaxes(vc, 1, 2), v_new], axis=1)  # [B, S + T, KV, hd]
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(vals.dtype), vals,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, hd).astype(q.dtype)
