"""A Llama-family decoder as pure functions over a weights pytree.

One `forward` serves prefill, one-token decode and multi-token (chain or tree) verification.
Covers Llama 2/3, SmolLM2 (llama arch), Qwen2/2.5 (q/k/v bias) and Qwen3 (q/k RMSNorm).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models.cache import KVCache, write_slots
from jspec.models.config import ModelConfig
from jspec.sharding import shard_kernel
from pallas_kernels.tree_attention import gpu_kernel_supports, tree_attention

# A large finite negative instead of -inf: a fully masked row then stays finite (no NaN).
MASK_VALUE = -1e30

# attention_impl="pallas" runs the tree-attention kernel for steps of at most this many new
# tokens per row (decode and verification); longer blocks (prefill) take the XLA path: the
# kernel holds all T·G queries of a KV head and a [T·G, T] tree-score tile in one block.
PALLAS_MAX_NEW_TOKENS = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    """One decoder layer's weights. Matrices are (in, out).

    Each layer owns separate buffers (no stacked [L, ...] arrays): on XLA:CPU a matmul that reads
    a slice of a stacked weight (what a layer `scan` does) copies it first and runs at about a
    third of the memory bandwidth of one that reads its own buffer.
    """

    attn_norm: jax.Array  # f32[D]
    wq: jax.Array  # dtype[D, H*hd]
    wk: jax.Array  # dtype[D, KV*hd]
    wv: jax.Array  # dtype[D, KV*hd]
    wo: jax.Array  # dtype[H*hd, D]
    mlp_norm: jax.Array  # f32[D]
    w_gate: jax.Array  # dtype[D, F]
    w_up: jax.Array  # dtype[D, F]
    w_down: jax.Array  # dtype[F, D]
    bq: jax.Array | None = None  # dtype[H*hd] (Qwen2)
    bk: jax.Array | None = None  # dtype[KV*hd]
    bv: jax.Array | None = None  # dtype[KV*hd]
    q_norm: jax.Array | None = None  # f32[hd] (Qwen3)
    k_norm: jax.Array | None = None  # f32[hd]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: jax.Array  # dtype[V, D]
    layers: tuple[LayerWeights, ...]  # one entry per layer
    final_norm: jax.Array  # f32[D]
    lm_head: jax.Array | None = None  # dtype[D, V]; None when tied to `embed`


@dataclasses.dataclass(frozen=True)
class Chain:
    """Causal attention among the new tokens (prefill, decode, chain verification)."""


@dataclasses.dataclass(frozen=True)
class Tree:
    """Tree attention among the new tokens: token t sees its ancestors and itself.

    `parents` is i32[T] or i32[B, T]; parents[t] < t, and -1 marks a root (its parent is the
    committed prefix).
    """

    parents: Any


def tree_ancestors(parents: jax.Array) -> jax.Array:
    """bool[..., T, T]: anc[t, u] is True when u is t itself or an ancestor of t."""
    parents = jnp.asarray(parents, jnp.int32)
    t = parents.shape[-1]
    eye = jnp.eye(t, dtype=bool)
    par = jax.nn.one_hot(parents, t, dtype=jnp.int32) > 0  # [..., T, T]; root rows all False
    anc = eye | par
    # Squaring the reachability relation doubles the path length covered each step.
    for _ in range(max(1, int(np.ceil(np.log2(max(t, 2)))))):
        anc = anc | (jnp.einsum("...tu,...uv->...tv", anc.astype(jnp.int32),
                                anc.astype(jnp.int32)) > 0)
    return anc


def rms_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / RMS(x) over the last axis, float32 (how target features are fed to drafters)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, cast back to x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def rope_angles(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) f32[B, T, 1, hd/2] of positions i32[B, T]: computed once per forward and
    shared by every layer."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    return jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x: [B, T, N, hd]; positions: i32[B, T]; inv_freq: f32[hd/2]."""
    return apply_rope(x, *rope_angles(positions, inv_freq))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE of x [B, T, N, hd] by angles from `rope_angles`."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def matmul(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """f32[..., F]: einsum(spec, x [..., D], w) with float32 accumulation.

    XLA:CPU runs a bfloat16 matmul with a single row on a slow path (measured here: ~8x a
    float32 one, ~9x a two-row bfloat16 one), while two or more rows take its fast bfloat16
    GEMM (a 2-16 token bfloat16 forward costs ~0.6-0.8x the float32 one;
    scripts/cpu_matmul_rows.py, docs/BENCHMARKS.md). So a one-row bfloat16 product on CPU is computed
    as two rows (the second zero) and the first kept: static shapes, no effect elsewhere.
    """
    lead = x.shape[:-1]
    if (math.prod(lead) == 1 and w.dtype == jnp.bfloat16
            and jax.default_backend() == "cpu"):
        x2 = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
        out = jnp.einsum(spec.replace("...", "m"), x2, w, preferred_element_type=jnp.float32)
        return out[:1].reshape(*lead, out.shape[-1])
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    return matmul("...d,df->...f", x, w).astype(x.dtype)


def attention_mask(cache_lengths: jax.Array, num_new: int, capacity: int,
                   mask: Chain | Tree) -> jax.Array:
    """bool[B, T, S]: which cache slots each new token attends to.

    New token t of row b sits in slot lengths[b] + t. It sees every committed slot
    (< lengths[b]) and, among the new slots, those the chain/tree mask allows.
    """
    slots = jnp.arange(capacity, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    start = cache_lengths[:, None, None]  # [B, 1, 1]
    committed = slots < start
    rel = slots - start  # index of the slot among the new tokens
    t_idx = jnp.arange(num_new, dtype=jnp.int32)[None, :, None]
    in_new = (rel >= 0) & (rel < num_new)
    if isinstance(mask, Tree):
        anc = tree_ancestors(mask.parents)  # [T, T] or [B, T, T]
        if anc.ndim == 2:
            anc = jnp.broadcast_to(anc, (cache_lengths.shape[0], num_new, num_new))
        rel_c = jnp.clip(rel, 0, num_new - 1)  # [B, 1, S]
        rel_b = jnp.broadcast_to(rel_c, (cache_lengths.shape[0], num_new, capacity))
        allowed = jnp.take_along_axis(anc, rel_b, axis=2)
    else:
        allowed = rel <= t_idx
    return committed | (in_new & allowed)


def _attention_xla(q: jax.Array, ck: jax.Array, cv: jax.Array, mask: jax.Array,
                   group: int) -> jax.Array:
    """dtype[B, T, H, hd]: masked attention of q [B, T, H, hd] over the whole cache buffer.

    ck, cv: dtype[B, KV, S, hd] (head-major), the new tokens already written; mask: bool[B,
    T, S] from `attention_mask`. The T·G queries of each KV head form one [T·G, hd] matrix, so
    both products are batched GEMMs over (row, KV head) that read the cache as it lies.
    """
    b, t, h, hd = q.shape
    kv = ck.shape[1]
    qg = jnp.moveaxis(q.reshape(b, t, kv, group, hd), 1, 2).reshape(b, kv, t * group, hd)
    scores = jnp.einsum("bkqd,bksd->bkqs", qg, ck, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / np.sqrt(hd))
    scores = jnp.where(jnp.repeat(mask, group, axis=1)[:, None], scores, MASK_VALUE)  # t*G+g
    probs = jax.nn.softmax(scores, axis=-1)
    attn = jnp.einsum("bkqs,bksd->bkqd", probs.astype(cv.dtype), cv,
                      preferred_element_type=jnp.float32).astype(q.dtype)
    return jnp.moveaxis(attn.reshape(b, kv, t, group, hd), 2, 1).reshape(b, t, h, hd)


@dataclasses.dataclass(frozen=True)
class _Attend:
    """How a layer attends: the XLA path's dense mask, or the Pallas kernel's inputs."""

    use_pallas: bool
    mask: jax.Array | None  # bool[B, T, S] (XLA path)
    lengths: jax.Array  # i32[B] committed prefix per row (Pallas path)
    parents: jax.Array | None  # i32[T] | i32[B, T] | None (chain) (Pallas path)


def _layer(config: ModelConfig, rot: tuple[jax.Array, jax.Array], x: jax.Array,
           attend: _Attend, ck: jax.Array, cv: jax.Array,
           lw: LayerWeights) -> tuple[jax.Array, jax.Array, jax.Array]:
    b, t, _ = x.shape
    h, kv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    g = config.group_size
    y = rms_norm(x, lw.attn_norm, config.rms_eps)
    q = _dot(y, lw.wq)
    k = _dot(y, lw.wk)
    v = _dot(y, lw.wv)
    if config.qkv_bias:
        q, k, v = q + lw.bq, k + lw.bk, v + lw.bv
    q = q.reshape(b, t, h, hd)
    k = k.reshape(b, t, kv, hd)
    v = v.reshape(b, t, kv, hd)
    if config.qk_norm:
        q = rms_norm(q, lw.q_norm, config.rms_eps)
        k = rms_norm(k, lw.k_norm, config.rms_eps)
    q = apply_rope(q, *rot)
    k = apply_rope(k, *rot)

    if attend.use_pallas:

        # Cascade form: the committed prefix is read from the cache, the T new tokens from
        # k/v directly (the new K/V are written after). Under a mesh the kernel runs per
        # device (shard_map) with specs from the logical-axis rules table.
        parents = (jnp.arange(t, dtype=jnp.int32) - 1 if attend.parents is None
                   else jnp.asarray(attend.parents, jnp.int32))
        parents = jnp.broadcast_to(parents, (b, t))
        qa, kva = ("batch", None, "heads", None), ("batch", None, "kv_heads", None)
        cache_a = ("batch", "kv_heads", None, None)
        attn = shard_kernel(tree_attention,
                            (qa, cache_a, cache_a, ("batch",), kva, kva, ("batch", None)), qa)(
            q, ck, cv, attend.lengths, k.astype(ck.dtype), v.astype(cv.dtype), parents)
        ck = write_slots(ck, k, attend.lengths)  # [B, KV, S, hd]
        cv = write_slots(cv, v, attend.lengths)
    else:
        # The new K/V are written first and attention reads the written buffer: reading the
        # unwritten one instead (prefix + new tokens apart) measured 1.3-1.4x slower at batch
        # 16-64 on XLA:CPU (a copy of every cache buffer per step).
        ck = write_slots(ck, k, attend.lengths)  # [B, KV, S, hd]
        cv = write_slots(cv, v, attend.lengths)
        attn = _attention_xla(q, ck, cv, attend.mask, g)
    x = x + _dot(attn.reshape(b, t, h * hd), lw.wo)

    y = rms_norm(x, lw.mlp_norm, config.rms_eps)
    act = jax.nn.silu(_dot(y, lw.w_gate).astype(jnp.float32)).astype(x.dtype) * _dot(y, lw.w_up)
    x = x + _dot(act, lw.w_down)
    return x, ck, cv


def lm_logits(config: ModelConfig, weights: Weights, h: jax.Array) -> jax.Array:
    """f32[..., V] logits from final-normed hidden states h: [..., D]."""
    if weights.lm_head is None:
        return matmul("...d,vd->...v", h, weights.embed)
    return matmul("...d,dv->...v", h, weights.lm_head)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardOutput:
    logits: jax.Array | None  # f32[B, T, V] (None when logits=False)
    cache: KVCache  # new K/V written at slots lengths+t; lengths unchanged
    hidden: jax.Array | None  # dtype[n, B, T, D]: hidden states of the requested layers
    final_hidden: jax.Array  # dtype[B, T, D]: after the final norm


def forward(config: ModelConfig, weights: Weights, tokens: jax.Array, positions: jax.Array,
            cache: KVCache, mask: Chain | Tree = Chain(), hidden_layers: tuple[int, ...] = (),
            compute_logits: bool = True, num_layers: int | None = None) -> ForwardOutput:
    """Run the decoder over T new tokens per row.

    Args:
      config: static model config.
      weights: the weights pytree.
      tokens: i32[B, T] new token ids.
      positions: i32[B, T] RoPE positions of the new tokens.
      cache: KV cache; the new tokens' K/V are written at slots `cache.lengths[b] + t`.
      mask: `Chain()` (causal among new tokens) or `Tree(parents)`.
      hidden_layers: static; indices of layers whose *output* hidden states to return
        (0 = the embeddings, i = after layer i).
      compute_logits: static; skip the LM head when False.
      num_layers: static; run only the first N layers (early-exit drafting), default all.

    `config.attention_impl` picks the attention: "xla" (dense mask over the whole cache) or
    "pallas" (`pallas_kernels.tree_attention`, cascade prefix + tree; interpret mode on CPU) for
    steps of at most PALLAS_MAX_NEW_TOKENS new tokens; "auto" is pallas on TPU, else xla.

    Returns:
      ForwardOutput with logits f32[B, T, V], the cache (lengths unchanged), hidden states.
    """
    t = tokens.shape[1]
    n_layers = config.num_layers if num_layers is None else num_layers
    rot = rope_angles(positions, jnp.asarray(config.inv_freq()))
    x = jnp.take(weights.embed, tokens, axis=0).astype(config.jnp_dtype)  # [B, T, D]
    use_pallas = config.resolved_attention_impl() == "pallas" and t <= PALLAS_MAX_NEW_TOKENS
    if use_pallas and config.attention_impl == "auto" and jax.default_backend() == "gpu":

        # "auto" on a GPU: the Mosaic GPU kernel where it applies, XLA elsewhere (an explicit
        # "pallas" outside the kernel's limits raises its clear error instead).
        use_pallas = gpu_kernel_supports(t, config.head_dim, cache.capacity, config.jnp_dtype)
    attend = _Attend(
        use_pallas=use_pallas,
        mask=None if use_pallas else attention_mask(cache.lengths, t, cache.capacity, mask),
        lengths=cache.lengths,
        parents=jnp.asarray(mask.parents, jnp.int32) if isinstance(mask, Tree) else None)
    want = tuple(sorted(set(hidden_layers)))
    for i in want:
        if not 0 <= i <= n_layers:
            raise ValueError(f"hidden layer {i} outside 0..{n_layers}")
    if len(cache.k) < n_layers:
        raise ValueError(f"cache has {len(cache.k)} layers, the forward runs {n_layers}")

    # A Python loop (unrolled at trace time) over per-layer buffers: see LayerWeights.
    states = [x]
    new_k, new_v = list(cache.k), list(cache.v)
    for i, lw in enumerate(weights.layers[:n_layers]):
        with jax.named_scope(f"layer_{i}"):
            x, new_k[i], new_v[i] = _layer(config, rot, x, attend, new_k[i], new_v[i], lw)
        if want:
            states.append(x)
    hidden = jnp.stack([states[i] for i in want]) if want else None
    h = rms_norm(x, weights.final_norm, config.rms_eps)
    logits = lm_logits(config, weights, h) if compute_logits else None
    return ForwardOutput(logits=logits,
                         cache=dataclasses.replace(cache, k=tuple(new_k), v=tuple(new_v)),
                         hidden=hidden, final_hidden=h)


def init_weights(config: ModelConfig, key: jax.Array, scale: float = 0.02) -> Weights:
    """Random weights for tests (tiny configs)."""
    d, f, h, kv, hd, n = (config.hidden_size, config.ffn_size, config.num_heads,
                          config.num_kv_heads, config.head_dim, config.num_layers)
    dt = config.jnp_dtype
    # 16 split keys (kept so existing seeds give the same weights), then fold_in keys for configs
    # that need more (q/k/v bias + q/k norm + untied head).
    ks = itertools.chain(jax.random.split(key, 16),
                         (jax.random.fold_in(key, i) for i in itertools.count(16)))

    def rnd(*shape):
        return (scale * jax.random.normal(next(ks), shape, jnp.float32)).astype(dt)

    def norm(*shape):
        return 1.0 + 0.1 * jax.random.normal(next(ks), shape, jnp.float32)

    stacked = LayerWeights(
        attn_norm=norm(n, d), wq=rnd(n, d, h * hd), wk=rnd(n, d, kv * hd), wv=rnd(n, d, kv * hd),
        wo=rnd(n, h * hd, d), mlp_norm=norm(n, d), w_gate=rnd(n, d, f), w_up=rnd(n, d, f),
        w_down=rnd(n, f, d),
        bq=rnd(n, h * hd) if config.qkv_bias else None,
        bk=rnd(n, kv * hd) if config.qkv_bias else None,
        bv=rnd(n, kv * hd) if config.qkv_bias else None,
        q_norm=norm(n, hd) if config.qk_norm else None,
        k_norm=norm(n, hd) if config.qk_norm else None)
    embed = (jax.random.normal(next(ks), (config.vocab_size, d), jnp.float32)).astype(dt)
    layers = tuple(jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n))
    return Weights(embed=embed, layers=layers, final_norm=norm(d),
                   lm_head=None if config.tie_embeddings else rnd(d, config.vocab_size))


def cast_weights(weights: Weights, dtype: Any) -> Weights:
    """Cast matrices to `dtype`; norms stay float32."""
    def cast(path, a):
        name = jax.tree_util.keystr(path)
        if a is None or "norm" in name:
            return a
        return a.astype(dtype)
    return jax.tree_util.tree_map_with_path(cast, weights)
