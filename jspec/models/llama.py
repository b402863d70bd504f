"""A Llama-family decoder as pure functions over a weights pytree.

One `forward` serves prefill, one-token decode and multi-token (chain or tree) verification.
Covers Llama 2/3, SmolLM2 (llama arch), Qwen2/2.5 (q/k/v bias) and Qwen3 (q/k RMSNorm).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec import platforms
from jspec.models.blocks import (
    Attend,
    Heads,
    LayerWeights,
    embed_rows,
    layer,
    matmul,
    rms_norm,
    rope_angles,
)
from jspec.models.cache import KVCache
from jspec.models.config import ModelConfig, resolve_attention_impl
from jspec.sharding import logical
from pallas_kernels.tree_attention import gpu_kernel_supports

# attention_impl="pallas" runs the tree-attention kernel for steps of at most this many new
# tokens per row (decode and verification); longer blocks (prefill) take the XLA path: the
# kernel holds all T·G queries of a KV head and a [T·G, T] tree-score tile in one block.
PALLAS_MAX_NEW_TOKENS = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: jax.Array = logical("vocab", "embed")  # dtype[V, D]
    # one entry per layer (each declares its own axes), or for scanned layers
    # (`ModelConfig.scan_layers`) one LayerWeights whose fields are stacks [L, ...]
    layers: tuple[LayerWeights, ...] | LayerWeights
    final_norm: jax.Array = logical(None)  # f32[D]
    lm_head: jax.Array | None = logical("embed", "vocab", default=None)  # dtype[D, V]; None: tied


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


def heads(config: ModelConfig) -> Heads:
    """The attention shape of `config`'s layers."""
    return Heads(config.num_heads, config.num_kv_heads, config.head_dim, config.rms_eps)


def lm_logits(config: ModelConfig, weights: Weights, h: jax.Array) -> jax.Array:
    """f32[..., V] logits from final-normed hidden states h: [..., D]."""
    if weights.lm_head is None:
        return matmul("...d,vd->...v", h, weights.embed)
    return matmul("...d,dv->...v", h, weights.lm_head)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardOutput:
    logits: jax.Array | None  # f32[B, T, V] (None when logits=False)
    cache: KVCache  # new K/V written at slots lengths+t (unless write_cache=False); lengths
    # unchanged
    hidden: jax.Array | None  # dtype[n, B, T, D]: hidden states of the requested layers
    final_hidden: jax.Array  # dtype[B, T, D]: after the final norm
    # write_cache=False: the new tokens' keys and values, dtype[L, B, T, KV, hd] each, for
    # `KVCache.write` (None when the forward wrote them)
    new_kv: tuple[jax.Array, jax.Array] | None = None


def forward(config: ModelConfig, weights: Weights, tokens: jax.Array, positions: jax.Array,
            cache: KVCache, mask: Chain | Tree = Chain(), hidden_layers: tuple[int, ...] = (),
            compute_logits: bool = True, num_layers: int | None = None,
            slots: int | None = None, write_cache: bool = True) -> ForwardOutput:
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
      slots: static; the caller promises every row's lengths + T <= slots, and attention reads
        only the first `slots` cache slots (prefill into an empty cache: T). Default: all.
      write_cache: static; False leaves the cache unwritten and returns the new K/V in
        `new_kv` (attention reads them apart from the committed slots): a caller that picks
        one of several forwards with `lax.switch` writes once after it, so the switch does not
        return (and XLA does not copy) every cache buffer.

    `config.attention_impl` picks the attention: "xla" (dense mask over the whole cache) or
    "pallas" (`pallas_kernels.tree_attention`, cascade prefix + tree; interpret mode on CPU) for
    steps of at most PALLAS_MAX_NEW_TOKENS new tokens; "auto" is pallas on TPU and GPU (where
    the GPU kernel applies), xla on CPU — for the platform the program is compiled for
    (`jspec.platforms`), not the host's.

    Returns:
      ForwardOutput with logits f32[B, T, V], the cache (lengths unchanged), hidden states.
    """
    t = tokens.shape[1]
    n_layers = config.num_layers if num_layers is None else num_layers
    rot = rope_angles(positions, jnp.asarray(config.inv_freq()))
    x = embed_rows(weights.embed, tokens, config.jnp_dtype)  # [B, T, D]
    if slots is not None and not t <= slots <= cache.capacity:
        raise ValueError(f"slots={slots} must lie in [{t} new tokens, {cache.capacity} capacity]")
    pallas_on = pallas_platforms(config, t, cache.capacity)
    tgt = platforms.target()
    # XLA masks only where some platform this program may be lowered for attends with XLA.
    xla_somewhere = (tgt not in pallas_on) if tgt else len(pallas_on) < len(platforms.PLATFORMS)
    # Scanned layers read the stacked cache only and write every layer's new K/V after the
    # loop: written inside it, XLA copied the whole stack in every layer (the kernel's read
    # and the in-place write of one buffer in one iteration).
    write_in_loop = write_cache and not config.scan_layers
    if write_in_loop:
        att_mask = attention_mask(cache.lengths, t, slots or cache.capacity,
                                  mask) if xla_somewhere else None
        new_mask = None
    else:  # committed slots through the cache, the new tokens apart
        att_mask = jnp.broadcast_to(
            jnp.arange(slots or cache.capacity, dtype=jnp.int32)[None, None, :]
            < cache.lengths[:, None, None],
            (cache.batch, t, slots or cache.capacity)) if xla_somewhere else None
        new_mask = (tree_ancestors(mask.parents) if isinstance(mask, Tree)
                    else jnp.tril(jnp.ones((t, t), bool)))
        new_mask = new_mask if new_mask.ndim == 3 else new_mask[None]
    at = Attend(
        pallas_on=pallas_on,
        mask=att_mask,
        lengths=cache.lengths,
        parents=jnp.asarray(mask.parents, jnp.int32) if isinstance(mask, Tree) else None,
        slots=slots, new_mask=new_mask)
    want = tuple(sorted(set(hidden_layers)))
    for i in want:
        if not 0 <= i <= n_layers:
            raise ValueError(f"hidden layer {i} outside 0..{n_layers}")
    stacked = not isinstance(weights.layers, tuple)
    if stacked != config.scan_layers or cache.stacked != config.scan_layers:
        raise ValueError(f"config.scan_layers={config.scan_layers} but the weights' layers are "
                         f"{'stacked' if stacked else 'per-layer'} and the cache "
                         f"{'stacked' if cache.stacked else 'per-layer'} (convert both with "
                         "Model.with_scan_layers / KVCache.create from the same config)")
    if cache.num_layers < n_layers:
        raise ValueError(f"cache has {cache.num_layers} layers, the forward runs {n_layers}")

    run = _scan_layers if stacked else _unrolled_layers
    x, ck, cv, hidden, new_kv = run(heads(config), weights.layers, n_layers, x, rot, at,
                                    cache.k, cache.v, want)
    cache = dataclasses.replace(cache, k=ck, v=cv)
    if write_cache and not write_in_loop:
        cache = cache.write(*new_kv)
    h = rms_norm(x, weights.final_norm, config.rms_eps)
    logits = lm_logits(config, weights, h) if compute_logits else None
    return ForwardOutput(logits=logits, cache=cache, hidden=hidden, final_hidden=h,
                         new_kv=None if write_cache else new_kv)


def _unrolled_layers(hs: Heads, layers: tuple[LayerWeights, ...], n: int, x: jax.Array,
                     rot: tuple[jax.Array, jax.Array], at: Attend, ck: tuple[jax.Array, ...],
                     cv: tuple[jax.Array, ...], want: tuple[int, ...]) -> tuple[Any, ...]:
    """The first n layers as a Python loop (unrolled at trace time) over per-layer buffers (see
    LayerWeights): (x, ck, cv, hidden dtype[len(want), B, T, D] | None, new K/V
    dtype[n, B, T, KV, hd] each)."""
    states = [x]
    new_k, new_v = list(ck), list(cv)
    kvs = []
    for i, lw in enumerate(layers[:n]):
        with jax.named_scope(f"layer_{i}"):
            x, new_k[i], new_v[i], kv = layer(hs, lw, x, rot, at, new_k[i], new_v[i])
        kvs.append(kv)
        if want:
            states.append(x)
    hidden = jnp.stack([states[i] for i in want]) if want else None
    new_kv = None if at.writes else tuple(jnp.stack(a) for a in zip(*kvs, strict=True))
    return x, tuple(new_k), tuple(new_v), hidden, new_kv


def _scan_layers(hs: Heads, layers: LayerWeights, n: int, x: jax.Array,
                 rot: tuple[jax.Array, jax.Array], at: Attend, ck: jax.Array, cv: jax.Array,
                 want: tuple[int, ...]) -> tuple[Any, ...]:
    """The first n layers as one `lax.scan` over stacked weights [L, ...] and a stacked cache
    [L, B, KV, S, hd] (written in place at the layer's index, or read only): what `_unrolled_layers`
    returns. The hidden states of the `want` layers are kept in a [len(want) + 1, B, T, D]
    carry, each layer writing its output to its slot (the last slot takes the rest)."""
    slot = np.full(n + 1, len(want), np.int32)
    slot[list(want)] = np.arange(len(want), dtype=np.int32)
    hid = jnp.zeros((len(want) + 1, *x.shape), x.dtype)
    hid = jax.lax.dynamic_update_index_in_dim(hid, x, int(slot[0]), 0)
    slot_of = jnp.asarray(slot)

    def body(carry, i):
        # A cache that is only read stays outside the carry (a loop invariant).
        x, hid, *kv_bufs = carry
        lw = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), layers)
        x, k_buf, v_buf, kv = layer(hs, lw, x, rot, at, *(kv_bufs or (ck, cv)),
                                    layer_index=i)
        if want:
            hid = jax.lax.dynamic_update_index_in_dim(hid, x, slot_of[i + 1], 0)
        if at.writes:
            return (x, hid, k_buf, v_buf), None
        return (x, hid), kv

    init = (x, hid, ck, cv) if at.writes else (x, hid)
    out, kvs = jax.lax.scan(body, init, jnp.arange(n, dtype=jnp.int32))
    x, hid = out[:2]
    if at.writes:
        ck, cv = out[2:]
    return x, ck, cv, (hid[:len(want)] if want else None), kvs


def pallas_platforms(config: ModelConfig, t: int, capacity: int) -> frozenset[str]:
    """The platforms on which a forward of `t` new tokens over a cache of `capacity` slots runs
    the Pallas attention kernel (`config.attention_impl`; XLA attention elsewhere)."""
    if t > PALLAS_MAX_NEW_TOKENS:
        return frozenset()
    on = {p for p in platforms.PLATFORMS
          if resolve_attention_impl(config.attention_impl, p) == "pallas"}
    if config.attention_impl == "auto" and not gpu_kernel_supports(t, config.head_dim, capacity,
                                                                   config.jnp_dtype):
        # "auto" on a GPU: the Mosaic GPU kernel where it applies, XLA elsewhere (an explicit
        # "pallas" outside the kernel's limits raises its clear error instead).
        on.discard("gpu")
    return frozenset(on)


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
    layers = stacked if config.scan_layers else tuple(
        jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n))
    return Weights(embed=embed, layers=layers, final_norm=norm(d),
                   lm_head=None if config.tie_embeddings else rnd(d, config.vocab_size))


def repeat_kv_heads(config: ModelConfig, weights: Weights, factor: int
                    ) -> tuple[ModelConfig, Weights]:
    """The same model with each KV head repeated `factor` times in place (kv0, kv0, kv1, ...):
    query head h still attends with KV head h // G of the original (G' = G / factor), so every
    output is unchanged. What a tensor-parallel width larger than the KV heads needs (8 KV heads
    on 16 chips): the K/V projections and the cache then shard over the chips instead of being
    replicated on each (`jspec.sharding`'s divisibility rule), at `factor` times the cache in
    all and 1/factor of it per chip.

    Args:
      config, weights: the model; `factor` must divide num_heads // num_kv_heads.
    Returns:
      (config with num_kv_heads * factor, weights with wk, wv, bk, bv repeated per head).
    """
    g = config.num_heads // config.num_kv_heads
    if factor < 1 or g % factor:
        raise ValueError(f"factor {factor} must divide the query heads per KV head ({g})")
    if factor == 1:
        return config, weights
    kv, hd = config.num_kv_heads, config.head_dim

    def rep(a: jax.Array | None) -> jax.Array | None:
        if a is None:
            return None
        lead = a.shape[:-1]
        a = a.reshape(*lead, kv, 1, hd)
        return jnp.broadcast_to(a, (*lead, kv, factor, hd)).reshape(*lead, kv * factor * hd)

    def rep_layer(lw: LayerWeights) -> LayerWeights:
        return dataclasses.replace(lw, wk=rep(lw.wk), wv=rep(lw.wv), bk=rep(lw.bk),
                                   bv=rep(lw.bv))

    layers = (tuple(rep_layer(lw) for lw in weights.layers)
              if isinstance(weights.layers, tuple) else rep_layer(weights.layers))
    return (dataclasses.replace(config, num_kv_heads=kv * factor),
            dataclasses.replace(weights, layers=layers))


def cast_weights(weights: Weights, dtype: Any) -> Weights:
    """Cast matrices to `dtype`; norms stay float32."""
    def cast(path, a):
        name = jax.tree_util.keystr(path)
        if a is None or "norm" in name:
            return a
        return a.astype(dtype)
    return jax.tree_util.tree_map_with_path(cast, weights)


def stack_layers(weights: Weights) -> Weights:
    """The weights with their layers as one LayerWeights of stacks [L, ...] (scanned layers;
    `ModelConfig.scan_layers`). Inverse of `unstack_layers`."""
    if not isinstance(weights.layers, tuple):
        return weights
    return dataclasses.replace(weights, layers=jax.tree.map(lambda *a: jnp.stack(a),
                                                            *weights.layers))


def unstack_layers(weights: Weights) -> Weights:
    """The weights with one LayerWeights per layer (unrolled layers). Inverse of
    `stack_layers`."""
    if isinstance(weights.layers, tuple):
        return weights
    n = jax.tree.leaves(weights.layers)[0].shape[0]
    return dataclasses.replace(weights, layers=tuple(
        jax.tree.map(lambda a, i=i: a[i], weights.layers) for i in range(n)))
