"""Transformer building blocks shared by the target and every trained drafter.

RMSNorm, RoPE, the projections (`dense`), one decoder layer's weights (`LayerWeights`, whose
fields declare their logical sharding axes), q/k/v, masked GQA attention with its XLA / Pallas
switch (`attend`), and the SwiGLU MLP. `jspec.models.llama` builds the target from them,
`jspec.drafters` (EAGLE-3, DFlash, D²SD) build their layers from them: a layer of either is
the same code on the same weights type, so both get the Pallas attention and the sharding
rules by construction.

Key/value buffers are head-major, dtype[B, KV, S, hd] (the KV cache's layout; see
`jspec.models.cache`), everywhere: the target's cache, the drafters' own caches and training.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec import platforms
from jspec.models import cpu_gemm
from jspec.models.cache import from_storage, write_slots
from jspec.sharding import logical, shard_kernel
from pallas_kernels.tree_attention import tree_attention, tree_attention_reference

# A large finite negative instead of -inf: a fully masked row then stays finite (no NaN).
MASK_VALUE = -1e30


# ----------------------------------------------------------------------------- norms, RoPE
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


# ----------------------------------------------------------------------------- projections
def embed_rows(table: jax.Array, ids: jax.Array,
               dtype: jax.typing.DTypeLike | None = None) -> jax.Array:
    """dtype[*ids.shape, D]: rows `ids` (i32, any shape) of an embedding table [V, D], in
    `dtype` (default the table's).

    A 16-bit table is gathered as its integer bits: XLA:CPU otherwise converts the whole table
    to float32 before gathering (float normalisation of a bfloat16 gather), and inside the
    decode loop that conversion is hoisted out as a float32 copy of the table made on every
    `generate` call (113 MB for SmolLM2's 49,152 x 576; docs/BENCHMARKS.md "Per-call copies
    of the embedding table"). The bitcasts are free there, not on TPU (see below).
    """
    if table.dtype.itemsize == 2 and jnp.issubdtype(table.dtype, jnp.floating):
        # On TPU the bitcast of the table is a copy of it (the whole shard, every step): there,
        # and on GPU, a plain gather (jspec.platforms: the platform compiled for).
        rows = platforms.choose(table, ids, cpu=_take_bits, default=_take)
    else:
        rows = _take(table, ids)
    return rows if dtype is None else rows.astype(dtype)


def _take(table: jax.Array, ids: jax.Array) -> jax.Array:
    return jnp.take(table, ids, axis=0)


def _take_bits(table: jax.Array, ids: jax.Array) -> jax.Array:
    bits = jnp.take(jax.lax.bitcast_convert_type(table, jnp.uint16), ids, axis=0)
    return jax.lax.bitcast_convert_type(bits, table.dtype)


def matmul(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """f32[..., F]: einsum(spec, x [..., D], w) with float32 accumulation; spec is
    "...d,df->...f" (w is (in, out)) or "...d,vd->...v" (w is (out, in): a tied LM head).

    On a CPU without bfloat16 matmul instructions, a product of a few rows (verifying K
    drafted tokens, a small batch) goes to `cpu_gemm`'s kernel, which reads each weight once:
    XLA:CPU's GEMM costs ~1.5x a one-row product at 2 rows and 2-3x at 4-8 rows there. On a
    CPU with AVX512-BF16 a bfloat16 product of up to 16 bfloat16 rows goes to its VDPBF16PS
    path (0.75-0.9x XLA's time in a target forward).

    Elsewhere XLA:CPU runs a bfloat16 matmul with a single row on a slow path (measured on a
    CPU with AVX512-BF16: ~8x a float32 one, ~9x a two-row bfloat16 one), while two or more rows
    take its fast bfloat16 GEMM (docs/journal/2026-11-30.md; `git show
    9eeace3:scripts/cpu_matmul_rows.py`). So there a one-row bfloat16 product is computed as
    two rows (the second zero) and the first kept: static shapes, no effect elsewhere.
    """
    if spec not in _SPECS:
        raise ValueError(f"matmul: unsupported spec {spec!r}")
    # The CPU paths only where the program is compiled for a CPU (jspec.platforms).
    return platforms.choose(x, w, cpu=functools.partial(_matmul_cpu, spec),
                            default=functools.partial(_matmul_xla, spec))


def _matmul_xla(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


def _matmul_cpu(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    lead = x.shape[:-1]
    rows = math.prod(lead)
    if cpu_gemm.use_for(rows, w.dtype, x.dtype):
        nt = spec == _NT
        out = cpu_gemm.small_gemm(x.reshape(rows, x.shape[-1]), w, nt)
        return out.reshape(*lead, out.shape[-1])
    if rows == 1 and w.dtype == jnp.bfloat16:
        x2 = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
        out = jnp.einsum(spec.replace("...", "m"), x2, w, preferred_element_type=jnp.float32)
        return out[:1].reshape(*lead, out.shape[-1])
    if spec == _NT:
        # A tied LM head over [B, T] rows as one [B*T, D] x [V, D]^T product: as a 3-D einsum
        # XLA:CPU lays w out transposed, a [D, V] copy made once per `generate` call.
        out = jnp.einsum("md,vd->mv", x.reshape(rows, x.shape[-1]), w,
                         preferred_element_type=jnp.float32)
        return out.reshape(*lead, out.shape[-1])
    return _matmul_xla(spec, x, w)


_NT = "...d,vd->...v"
_SPECS = ("...d,df->...f", "...d,dv->...v", _NT)


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """f32[..., F] = x [..., D] @ w [D, F], in w's dtype with float32 accumulation."""
    return matmul("...d,df->...f", x.astype(w.dtype), w)


# ----------------------------------------------------------------------------- one layer
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    """One decoder layer's weights (the target's and a trained drafter's). Matrices are
    (in, out); each field declares its logical axes (`jspec.sharding.RULES`).

    By default each layer owns separate buffers (no stacked [L, ...] arrays): on XLA:CPU a matmul
    that reads a slice of a stacked weight (what a layer `scan` does) copies it first and runs at
    about a third of the memory bandwidth of one that reads its own buffer. For TPU the target's
    layers are one LayerWeights of stacks (`ModelConfig.scan_layers`).
    """

    attn_norm: jax.Array | None = logical(None, stackable=True)  # f32[D]; None: the input is normed already
    wq: jax.Array = logical("embed", "heads", stackable=True)  # dtype[Din, H*hd]
    wk: jax.Array = logical("embed", "kv_heads", stackable=True)  # dtype[Din, KV*hd]
    wv: jax.Array = logical("embed", "kv_heads", stackable=True)  # dtype[Din, KV*hd]
    wo: jax.Array = logical("heads", "embed", stackable=True)  # dtype[H*hd, D]
    mlp_norm: jax.Array = logical(None, stackable=True)  # f32[D]
    w_gate: jax.Array = logical("embed", "mlp", stackable=True)  # dtype[D, F]
    w_up: jax.Array = logical("embed", "mlp", stackable=True)  # dtype[D, F]
    w_down: jax.Array = logical("mlp", "embed", stackable=True)  # dtype[F, D]
    bq: jax.Array | None = logical("heads", default=None, stackable=True)  # dtype[H*hd] (Qwen2)
    bk: jax.Array | None = logical("kv_heads", default=None, stackable=True)  # dtype[KV*hd]
    bv: jax.Array | None = logical("kv_heads", default=None, stackable=True)  # dtype[KV*hd]
    q_norm: jax.Array | None = logical(None, default=None, stackable=True)  # f32[hd] (Qwen3, DFlash release)
    k_norm: jax.Array | None = logical(None, default=None, stackable=True)  # f32[hd]


@dataclasses.dataclass(frozen=True)
class Heads:
    """Static attention shape: query heads, KV heads, head size, RMSNorm epsilon."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def qkv(hs: Heads, lw: LayerWeights, y: jax.Array, rot: tuple[jax.Array, jax.Array]
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """RoPE'd q [B, T, H, hd], k, v [B, T, KV, hd] (y's dtype) from normed y [B, T, Din]:
    the projections, their biases (when `lw.bq` is set), per-head q/k RMSNorm (when
    `lw.q_norm` is set), then RoPE by `rot` (`rope_angles`)."""
    b, t, _ = y.shape
    q = dense(y, lw.wq).astype(y.dtype)
    k = dense(y, lw.wk).astype(y.dtype)
    v = dense(y, lw.wv).astype(y.dtype)
    if lw.bq is not None:
        q, k, v = q + lw.bq, k + lw.bk, v + lw.bv
    q = q.reshape(b, t, hs.num_heads, hs.head_dim)
    k = k.reshape(b, t, hs.num_kv_heads, hs.head_dim)
    v = v.reshape(b, t, hs.num_kv_heads, hs.head_dim)
    if lw.q_norm is not None:
        q = rms_norm(q, lw.q_norm, hs.eps)
        k = rms_norm(k, lw.k_norm, hs.eps)
    return apply_rope(q, *rot), apply_rope(k, *rot), v


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
              own: tuple[jax.Array, jax.Array] | None = None,
              new: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> jax.Array:
    """q's dtype[B, T, H, hd]: masked GQA attention of q [B, T, H, hd] over head-major keys
    and values k, v [B, KV, S, hd]; mask: bool[B, T, S].

    `own` (EAGLE-3's training-time test): per-query keys and values [B, T, E, KV, hd] that
    query t attends to besides k, v (always visible), in the same softmax.
    `new` (a forward that leaves the cache unwritten): the new tokens' own keys and values
    [B, T, KV, hd] and which of them each query sees, bool[B | 1, T, T], in the same softmax.

    The T·G queries of each KV head form one [T·G, hd] matrix, so both products are batched
    GEMMs over (row, KV head) that read the buffers as they lie.
    """
    b, t, h, hd = q.shape
    kv = k.shape[1]
    g = h // kv
    s = k.shape[2]
    qg = jnp.moveaxis(q.reshape(b, t, kv, g, hd), 1, 2).reshape(b, kv, t * g, hd)
    scores = jnp.einsum("bkqd,bksd->bkqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / np.sqrt(hd))
    scores = jnp.where(jnp.repeat(mask, g, axis=1)[:, None], scores, MASK_VALUE)  # t*G+g
    if own is not None:
        # [B, T, E, KV, hd] -> [B, KV, T*G, E, hd] (query t*G+g reads its row t)
        ok, ov = (jnp.repeat(jnp.moveaxis(a, (1, 2), (2, 3)), g, axis=2) for a in own)
        so = jnp.einsum("bkqd,bkqed->bkqe", qg, ok, preferred_element_type=jnp.float32)
        scores = jnp.concatenate([scores, so * (1.0 / np.sqrt(hd))], axis=-1)
    if new is not None:
        nk, nv = (jnp.swapaxes(a, 1, 2) for a in new[:2])  # [B, KV, T, hd]
        sn = jnp.einsum("bkqd,bktd->bkqt", qg, nk.astype(qg.dtype),
                        preferred_element_type=jnp.float32) * (1.0 / np.sqrt(hd))
        sn = jnp.where(jnp.repeat(new[2], g, axis=1)[:, None], sn, MASK_VALUE)
        scores = jnp.concatenate([scores, sn], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)
    attn = jnp.einsum("bkqs,bksd->bkqd", probs[..., :s].astype(v.dtype), v,
                      preferred_element_type=jnp.float32)
    if own is not None:
        attn = attn + jnp.einsum("bkqe,bkqed->bkqd", probs[..., s:].astype(ov.dtype), ov,
                                 preferred_element_type=jnp.float32)
    if new is not None:
        attn = attn + jnp.einsum("bkqt,bktd->bkqd", probs[..., s:].astype(nv.dtype), nv,
                                 preferred_element_type=jnp.float32)
    return jnp.moveaxis(attn.astype(q.dtype).reshape(b, kv, t, g, hd), 2, 1).reshape(b, t, h, hd)


@dataclasses.dataclass(frozen=True)
class Attend:
    """How a layer attends to a cache: the XLA path's dense mask, or the Pallas kernel's inputs.

    The new tokens of row b sit at slots lengths[b] + t. XLA: `mask` bool[B, T, S] (from
    `jspec.models.llama.attention_mask`) over the first `slots` slots (the caller's static
    promise that lengths + T <= slots: prefill into an empty cache reads T slots, not the
    capacity). Pallas: the committed prefix (< lengths) plus the
    new tokens under the chain (parents None) or tree (`parents` i32[T] | i32[B, T]) mask.
    """

    pallas_on: frozenset[str]  # platforms ("cpu" | "gpu" | "tpu") that run the Pallas kernel
    mask: jax.Array | None  # bool[B, T, S] (XLA path)
    lengths: jax.Array  # i32[B] committed prefix per row
    parents: jax.Array | None = None  # i32[T] | i32[B, T] | None (chain) (Pallas path)
    slots: int | None = None  # static: XLA attention reads only slots [0, slots); None: all
    # Leave the cache unwritten (the caller writes the returned new K/V later): the XLA path
    # then reads the committed slots through `mask` and the new tokens apart, through
    # `new_mask` bool[B | 1, T, T]; the Pallas path reads them apart either way.
    new_mask: jax.Array | None = None

    @property
    def writes(self) -> bool:
        return self.new_mask is None


def attend(at: Attend, q: jax.Array, k: jax.Array, v: jax.Array, ck: jax.Array,
           cv: jax.Array, layer_index: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write the new k, v [B, T, KV, hd] at slots lengths + t of the cache buffers ck, cv
    dtype[B, KV, S, hd] and attend to it: (attn q's dtype[B, T, H, hd], ck, cv). With
    `at.new_mask` set, ck and cv come back unwritten. `layer_index` (i32 scalar, scanned
    layers): ck, cv are stacks dtype[L, B, KV, S, hd], this layer's are read at that index,
    and the caller writes the new K/V (`at.new_mask` must be set: `KVCache.write`)."""
    if layer_index is not None and at.writes:
        raise ValueError("a stacked cache is read only inside the layer loop: set new_mask")
    if not at.pallas_on:
        return _attend_xla(at, q, k, v, ck, cv, layer_index)
    # The Pallas kernel or XLA attention, for the platform the program is compiled for.
    branch = {p: (functools.partial(_attend_pallas, at, p) if p in at.pallas_on
                  else functools.partial(_attend_xla, at)) for p in platforms.PLATFORMS}
    return platforms.choose(q, k, v, ck, cv, layer_index, **branch)


def _attend_pallas(at: Attend, platform: str, q: jax.Array, k: jax.Array, v: jax.Array,
                   ck: jax.Array, cv: jax.Array, layer_index: jax.Array | None
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    # Cascade form: the committed prefix is read from the cache, the T new tokens from
    # k/v directly (the new K/V are written after). Under a mesh the kernel runs per
    # device (shard_map) with specs from the logical-axis rules table.
    b, t = q.shape[:2]
    parents = (jnp.arange(t, dtype=jnp.int32) - 1 if at.parents is None
               else jnp.asarray(at.parents, jnp.int32))
    parents = jnp.broadcast_to(parents, (b, t))
    qa, kva = ("batch", None, "heads", None), ("batch", None, "kv_heads", None)
    cache_a = ("batch", "kv_heads", None, None)
    rk, rv = from_storage(ck, q.dtype), from_storage(cv, q.dtype)
    args = (q, rk, rv, at.lengths, k.astype(rk.dtype), v.astype(rv.dtype), parents)
    axes = (qa, cache_a, cache_a, ("batch",), kva, kva, ("batch", None))
    if layer_index is not None:  # the whole stack goes in; the kernel reads its layer's tiles
        stack_a = (None, *cache_a)
        args, axes = (*args, layer_index), (qa, stack_a, stack_a, *axes[3:], ())
    attn = shard_kernel(_kernel_with_reference_jvp(platform), axes, qa)(*args)
    if not at.writes:
        return attn, ck, cv
    return attn, write_slots(ck, k, at.lengths), write_slots(cv, v, at.lengths)


@functools.cache
def _kernel_with_reference_jvp(platform: str) -> Any:
    """`tree_attention` for `platform`, differentiable: a Pallas call has no derivative rule, so
    its tangents are those of `tree_attention_reference` (same math, plain XLA). What lets a
    user take gradients through a forward that runs the kernel (a policy-gradient loss inside
    the same jit, on TPU, or with the platform left to lowering)."""
    @jax.custom_jvp
    def kernel(*args: jax.Array) -> jax.Array:
        return tree_attention(*args, platform=platform)

    @kernel.defjvp
    def _jvp(primals: tuple, tangents: tuple) -> tuple[jax.Array, jax.Array]:
        return kernel(*primals), jax.jvp(tree_attention_reference, primals, tangents)[1]

    return kernel


def _attend_xla(at: Attend, q: jax.Array, k: jax.Array, v: jax.Array, ck: jax.Array,
                cv: jax.Array, layer_index: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    n = ck.shape[-2] if at.slots is None else at.slots

    def read(buf: jax.Array) -> jax.Array:  # this layer's first n slots, in q's dtype
        if layer_index is not None:
            buf = jax.lax.dynamic_index_in_dim(buf, layer_index, keepdims=False)
        return from_storage(buf[:, :, :n], q.dtype)

    if not at.writes:
        return attention(q, read(ck), read(cv), at.mask, new=(k, v, at.new_mask)), ck, cv
    # The new K/V are written first and attention reads the written buffer: reading the
    # unwritten one and writing it after, in the same layer, measured 1.3-1.4x slower at batch
    # 16-64 on XLA:CPU (a copy of every cache buffer per step). Unwritten (above) is for a
    # forward whose caller writes after the whole forward (a verify switch's branch).
    ck = write_slots(ck, k, at.lengths)  # [B, KV, S, hd]
    cv = write_slots(cv, v, at.lengths)
    return attention(q, read(ck), read(cv), at.mask), ck, cv


def mlp(lw: LayerWeights, x: jax.Array, eps: float) -> jax.Array:
    """x + SwiGLU(RMSNorm(x)) in x's dtype (products accumulated in float32)."""
    y = rms_norm(x, lw.mlp_norm, eps)
    gate = dense(y, lw.w_gate).astype(x.dtype)
    act = jax.nn.silu(gate.astype(jnp.float32)).astype(x.dtype) * dense(y, lw.w_up).astype(
        x.dtype)
    return x + dense(act, lw.w_down).astype(x.dtype)


def layer(hs: Heads, lw: LayerWeights, x: jax.Array, rot: tuple[jax.Array, jax.Array],
          at: Attend, ck: jax.Array, cv: jax.Array, *, y: jax.Array | None = None,
          residual: jax.Array | None = None, layer_index: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
    """One pre-norm decoder layer over a cache: (x', ck, cv, (k, v)).

    x: [B, T, D]; q/k/v read `y` (default RMSNorm(x) by `lw.attn_norm`); the attention output
    is added to `residual` (default x), then the MLP block. (k, v) [B, T, KV, hd] are the new
    tokens' keys and values (what `attend` wrote, or leaves to the caller: `Attend.new_mask`).
    `layer_index`: ck, cv are stacks of every layer's buffers and this is the layer (`attend`).
    """
    b, t, _ = x.shape
    if y is None:
        y = rms_norm(x, lw.attn_norm, hs.eps)
    q, k, v = qkv(hs, lw, y, rot)
    attn, ck, cv = attend(at, q, k, v, ck, cv, layer_index)
    x = (x if residual is None else residual) + dense(
        attn.reshape(b, t, hs.num_heads * hs.head_dim), lw.wo).astype(x.dtype)
    return mlp(lw, x, hs.eps), ck, cv, (k, v)
