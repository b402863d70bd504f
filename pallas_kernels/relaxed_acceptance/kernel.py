"""Fused relaxed acceptance over vocabulary tiles: lossless (w = 1) and DIVERSED (w < 1).

For drafted tokens x_1..x_K with draft distributions q_i, target logits z_0..z_K and a weight w
(per row), with p_i = softmax(z_i / temperature) and the verifier distribution
ν_i = w·p_i + (1 - w)·q_i (ALGORITHMS.md §1 and §3):
  * accept x_i with probability min(1, ν_i(x_i) / q_i(x_i)), i.e. iff u_i·q_i(x_i) < ν_i(x_i);
  * n = the first rejected position (K if none): the accepted prefix length;
  * at a rejection, the next token is drawn from norm([ν_n - q_n]_+) = norm([p_n - q_n]_+)
    (from p_n when that mass is <= RESIDUAL_EPS or the slot held no draft); after K acceptances
    it is the bonus token, drawn from p_K. Sampling is Gumbel-max with the given noise g:
    argmax_v log r(v) + g(v), computed tile by tile (a running max per row).
Greedy (temperature 0): x_i is accepted iff it is the first argmax of z_i (w = None) or of
ν_i = w·softmax(z_i) + (1 - w)·q_i (w given); the next token is that argmax at position n
(of z_n when the slot held no draft, and of z_K for the bonus).

Two `pallas_call`s, each one pass over vocabulary tiles, and no [.., V] softmax array in memory:
  1. `_stats_kernel`, grid (B, phases, V tiles): for every position an online softmax (running
     max and sum), the first argmax, z(x_i) and q(x_i); on the last tile it decides acceptance,
     n, and what the residual pass needs (log-normaliser of position n, whether n held a draft).
     Greedy with a weight w runs a second phase over the tiles for argmax ν (which needs the
     normaliser first).
  2. `_residual_kernel`, grid (B, V tiles), sampling only: runs the Gumbel-max over
     [p_n - q_n]_+ and p_n. With one row per grid step it reads *only* position n's tiles (the
     row index comes from scalar prefetch); with `block_b` rows per step it reads their K+1
     positions and selects n in the kernel (fewer, larger steps: what interpret mode needs).
Between the two only O(B·K) scalars exist.

Backends: this file's kernels are written for TPU (Mosaic): scalar prefetch via
`pltpu.PrefetchScalarGridSpec`, blocks whose last two dims are (rows, vocab tile) with the tile a
multiple of 128; on CPU they run in interpret mode (what the tests run). On a GPU,
`relaxed_acceptance` calls the Mosaic GPU kernels of `kernel_mgpu.py` instead (the vocabulary of
each row split over many CTAs, partial statistics merged in jnp).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._platform import dispatch
from pallas_kernels.relaxed_acceptance.decide import (
    BIG_INDEX,
    MASK_VALUE,
    MIN_TEMPERATURE,
    RESIDUAL_EPS,
)
from pallas_kernels.relaxed_acceptance.kernel_mgpu import relaxed_acceptance_mgpu
from pallas_kernels.relaxed_acceptance.tuned_block_sizes import (
    pick_block_b,
    pick_block_v,
    pick_block_v_gpu,
)

_BIG = BIG_INDEX


class Acceptance(NamedTuple):
    """The verdict on one round of drafts."""

    n_accepted: jax.Array  # i32[B] in [0, K]: accepted prefix length (first rejection)
    next_token: jax.Array  # i32[B]: the correction (at position n < K) or bonus token
    accept_prob: jax.Array  # f32[B, K]: min(1, ν(x)/q(x)) per drafted token (greedy: 0/1); 0
    #                         where the slot held no draft


def _first_argmax(x: jax.Array, col: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(max, index of its first occurrence) over the last axis of x f32[bb, R, tv], keepdims.

    col: i32[1, 1, tv] global vocabulary index of each lane.
    """
    mx = jnp.max(x, axis=2, keepdims=True)
    idx = jnp.min(jnp.where(x == mx, col, _BIG), axis=2, keepdims=True)
    return mx, idx


def _pick_row(vec: jax.Array, row: jax.Array) -> jax.Array:
    """vec[:, row] as [bb, 1, 1] from vec [bb, R, 1] and row i32[bb, 1, 1], with no gather."""
    iota = jax.lax.broadcasted_iota(jnp.int32, vec.shape, 1)
    return jnp.sum(jnp.where(iota == row, vec, jnp.zeros_like(vec)), axis=1, keepdims=True)


def _stats_kernel(
    # Inputs
    z_ref,  # f32|bf16[bb, K+1, tv]: target logits of bb rows, one vocabulary tile
    q_ref,  # f32[bb, K, tv]: draft probabilities (None when the draft is one-hot)
    x_ref,  # i32[bb, K, 1]: drafted tokens
    valid_ref,  # i32[bb, K, 1]: 1 where the drafter proposed a token
    u_ref,  # f32[bb, K, 1]: uniforms of the acceptance tests (unused when greedy)
    w_ref,  # f32[bb, 1, 1]: weight on the target (1 = lossless)
    # Outputs
    n_ref,  # i32[bb, 1, 1]: accepted prefix length
    tok_ref,  # i32[bb, 1, 1]: greedy next token (sampling: -1, the residual pass decides)
    prob_ref,  # f32[bb, K, 1]: acceptance probability of each drafted token
    lse_ref,  # f32[bb, 1, 1]: log-normaliser of p at position n
    prop_ref,  # i32[bb, 1, 1]: 1 when position n < K held a draft (the residual subtracts q_n)
    xn_ref,  # i32[bb, 1, 1]: the drafted token at min(n, K-1)
    # Scratch
    m_sc,  # f32[bb, K+1, 1]: running max of z
    l_sc,  # f32[bb, K+1, 1]: running sum of exp(z - max)
    aidx_sc,  # i32[bb, K+1, 1]: index of the first argmax of z (its value is m_sc)
    zx_sc,  # f32[bb, K, 1]: z_i(x_i)
    qx_sc,  # f32[bb, K, 1]: q_i(x_i)
    nmax_sc,  # f32[bb, K, 1]: running max of ν (greedy with w)
    nidx_sc,  # i32[bb, K, 1]: first argmax of ν (greedy with w)
    *, temperature: float, vocab: int, block_v: int, num_drafts: int, one_hot: bool,
    weighted: bool):
    k = num_drafts
    greedy = temperature == 0
    phase = pl.program_id(1)
    j = pl.program_id(2)
    last_phase = pl.num_programs(1) - 1
    last_tile = pl.num_programs(2) - 1
    col = j * block_v + jax.lax.broadcasted_iota(jnp.int32, (1, 1, block_v), 2)
    in_vocab = col < vocab  # the last tile may overhang the vocabulary (junk/NaN there)
    z = z_ref[...].astype(jnp.float32)
    if not greedy:
        z = z / temperature
    z = jnp.where(in_vocab, z, MASK_VALUE)  # [bb, K+1, tv]
    x = x_ref[...]
    hit = (col == x) & in_vocab  # [bb, K, tv]
    q = hit.astype(jnp.float32) if one_hot else jnp.where(in_vocab, q_ref[...].astype(jnp.float32),
                                                           0.0)

    @pl.when((phase == 0) & (j == 0))
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        aidx_sc[...] = jnp.zeros(aidx_sc.shape, jnp.int32)
        zx_sc[...] = jnp.zeros(zx_sc.shape, jnp.float32)
        qx_sc[...] = jnp.zeros(qx_sc.shape, jnp.float32)
        nmax_sc[...] = jnp.full(nmax_sc.shape, -1.0, jnp.float32)
        nidx_sc[...] = jnp.zeros(nidx_sc.shape, jnp.int32)

    @pl.when(phase == 0)
    def _stats():
        mx, idx = _first_argmax(z, col)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, mx)
        l_sc[...] = l_sc[...] * jnp.exp(m_prev - m_new) + jnp.sum(jnp.exp(z - m_new), axis=2,
                                                                  keepdims=True)
        m_sc[...] = m_new
        aidx_sc[...] = jnp.where(mx > m_prev, idx, aidx_sc[...])  # strict: earlier tiles win ties
        zx_sc[...] += jnp.sum(jnp.where(hit, z[:, :k], 0.0), axis=2, keepdims=True)
        qx_sc[...] += jnp.sum(jnp.where(hit, q, 0.0), axis=2, keepdims=True)

    if greedy and weighted:
        @pl.when(phase == 1)
        def _nu_argmax():
            lse = m_sc[...] + jnp.log(l_sc[...])
            w = w_ref[...]
            qv = q * valid_ref[...].astype(jnp.float32)
            nu = w * jnp.exp(z[:, :k] - lse[:, :k]) + (1.0 - w) * qv
            nu = jnp.where(in_vocab, nu, -1.0)
            mx, idx = _first_argmax(nu, col)
            better = mx > nmax_sc[...]
            nmax_sc[...] = jnp.where(better, mx, nmax_sc[...])
            nidx_sc[...] = jnp.where(better, idx, nidx_sc[...])

    @pl.when((phase == last_phase) & (j == last_tile))
    def _decide():
        valid = valid_ref[...] > 0  # [bb, K, 1]
        lse = m_sc[...] + jnp.log(l_sc[...])  # [bb, K+1, 1]
        target_tok = aidx_sc[...]  # [bb, K+1, 1]
        if greedy:
            choice = nidx_sc[...] if weighted else target_tok[:, :k]
            accept = valid & (x == choice)
            prob = accept.astype(jnp.float32)
        else:
            w = w_ref[...]
            qx = qx_sc[...]
            nu_x = w * jnp.exp(zx_sc[...] - lse[:, :k]) + (1.0 - w) * qx
            accept = valid & (u_ref[...] * qx < nu_x)  # u < ν/q without dividing
            ratio = jnp.minimum(1.0, nu_x / jnp.where(qx > 0, qx, 1.0))
            prob = jnp.where(valid, jnp.where(qx > 0, ratio, 1.0), 0.0)
        iota_k = jax.lax.broadcasted_iota(jnp.int32, accept.shape, 1)
        n = jnp.min(jnp.where(accept, k, iota_k), axis=1, keepdims=True)  # [bb, 1, 1]
        row = jnp.minimum(n, k - 1)
        proposed = (n < k) & (_pick_row(valid.astype(jnp.int32), row) > 0)
        n_ref[...] = n
        prob_ref[...] = prob
        lse_ref[...] = _pick_row(lse, n)
        prop_ref[...] = proposed.astype(jnp.int32)
        xn_ref[...] = _pick_row(x, row)
        if greedy:
            tok = _pick_row(target_tok, n)
            if weighted:
                tok = jnp.where(proposed, _pick_row(nidx_sc[...], row), tok)
            tok_ref[...] = tok
        else:
            tok_ref[...] = jnp.full(tok_ref.shape, -1, jnp.int32)


def _residual_kernel(
    # Scalar prefetch
    zrow_ref,  # i32[B] (SMEM): block row of the logits to read (used by the index maps only)
    qrow_ref,  # i32[B] (SMEM): block row of q to read (index maps only)
    # Inputs
    z_ref,  # f32|bf16[bb, R, tv]: target logits, R = 1 (position n, gathered by the index
    #         map, when bb = 1) or R = K+1 (all positions, row n selected here)
    q_ref,  # f32[bb, R', tv]: draft probabilities likewise (None when one-hot)
    sel_ref,  # i32[bb, 3, 1]: per row (row of z to use, row of q to use, position n held a draft)
    xn_ref,  # i32[bb, 1, 1]: the drafted token at min(n, K-1) (one-hot drafts)
    g_ref,  # f32[bb, 1, tv]: Gumbel noise
    lse_ref,  # f32[bb, 1, 1]: log-normaliser of p_n
    # Outputs
    tok_ref,  # i32[bb, 1, 1]: the sampled token
    # Scratch
    best_r,  # f32[bb, 1, 1]: running max of log r + g over r = [p_n - q_n]_+
    idx_r,  # i32[bb, 1, 1]
    best_p,  # f32[bb, 1, 1]: running max of log p + g (fallback when the residual is empty)
    idx_p,  # i32[bb, 1, 1]
    mass,  # f32[bb, 1, 1]: residual mass so far
    *, temperature: float, vocab: int, block_v: int, one_hot: bool):
    del zrow_ref, qrow_ref
    j = pl.program_id(1)
    col = j * block_v + jax.lax.broadcasted_iota(jnp.int32, (1, 1, block_v), 2)
    in_vocab = col < vocab

    @pl.when(j == 0)
    def _init():
        best_r[...] = jnp.full(best_r.shape, MASK_VALUE, jnp.float32)
        best_p[...] = jnp.full(best_p.shape, MASK_VALUE, jnp.float32)
        idx_r[...] = jnp.zeros(idx_r.shape, jnp.int32)
        idx_p[...] = jnp.zeros(idx_p.shape, jnp.int32)
        mass[...] = jnp.zeros(mass.shape, jnp.float32)

    sel = sel_ref[...]
    z_row, q_row, proposed = sel[:, 0:1], sel[:, 1:2], sel[:, 2:3] > 0  # [bb, 1, 1] each

    def select(ref, row):  # [bb, 1, tv]: row `row` of each block row, masked sum (no gather)
        a = ref[...].astype(jnp.float32)
        if a.shape[1] == 1:
            return a
        iota = jax.lax.broadcasted_iota(jnp.int32, a.shape, 1)
        return jnp.sum(jnp.where(iota == row, a, 0.0), axis=1, keepdims=True)

    logp = jnp.where(in_vocab, select(z_ref, z_row) / temperature - lse_ref[...], MASK_VALUE)
    p = jnp.exp(logp)
    q = (col == xn_ref[...]).astype(jnp.float32) if one_hot else select(q_ref, q_row)
    q = jnp.where(in_vocab & proposed, q, 0.0)
    r = jnp.maximum(p - q, 0.0)
    g = jnp.where(in_vocab, g_ref[...], 0.0)
    mass[...] += jnp.sum(r, axis=2, keepdims=True)
    for key, best, idx in ((jnp.where(r > 0, jnp.log(jnp.where(r > 0, r, 1.0)) + g, MASK_VALUE),
                            best_r, idx_r),
                           (jnp.where(in_vocab, logp + g, MASK_VALUE), best_p, idx_p)):
        mx, ix = _first_argmax(key, col)
        better = mx > best[...]
        best[...] = jnp.where(better, mx, best[...])
        idx[...] = jnp.where(better, ix, idx[...])

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        tok_ref[...] = jnp.where(mass[...] > RESIDUAL_EPS, idx_r[...], idx_p[...])


def _check_inputs(target_logits, draft, q, valid, w, uniforms, gumbel, temperature) -> None:
    if target_logits.ndim != 3 or draft.ndim != 2:
        raise ValueError(f"expected target_logits [B, K+1, V] and draft [B, K], got "
                         f"{target_logits.shape} and {draft.shape}")
    b, k1, v = target_logits.shape
    k = k1 - 1
    if draft.shape != (b, k) or k < 1 or not jnp.issubdtype(draft.dtype, jnp.integer):
        raise ValueError(f"draft must be i32[{b}, {k}] (K >= 1), got {draft.dtype}{list(draft.shape)}")
    if target_logits.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"target_logits must be float32 or bfloat16, got {target_logits.dtype}")
    if q is not None and q.shape != (b, k, v):
        raise ValueError(f"q must be f32[{b}, {k}, {v}] or None, got {list(q.shape)}")
    if valid is not None and valid.shape != (b, k):
        raise ValueError(f"valid must be bool[{b}, {k}] or None, got {list(valid.shape)}")
    if w is not None and jnp.shape(w) not in ((), (b,)):
        raise ValueError(f"w must be a scalar or f32[{b}], got shape {jnp.shape(w)}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be a float >= 0, got {temperature!r}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature {temperature!r} is below MIN_TEMPERATURE "
                         f"({MIN_TEMPERATURE}): logits / temperature would overflow float32; use "
                         "temperature 0 (greedy) or the jnp path (jspec.verify.verify_chain)")
    if temperature > 0:
        if uniforms is None or uniforms.shape != (b, k):
            raise ValueError(f"sampling needs uniforms f32[{b}, {k}]")
        if gumbel is None or gumbel.shape != (b, v):
            raise ValueError(f"sampling needs gumbel noise f32[{b}, {v}]")


def _common(draft, valid, w, uniforms, b, k):
    x = draft.astype(jnp.int32)
    ok = jnp.ones((b, k), jnp.int32) if valid is None else valid.astype(jnp.int32)
    u = jnp.zeros((b, k), jnp.float32) if uniforms is None else uniforms.astype(jnp.float32)
    wv = jnp.ones((b,), jnp.float32) if w is None else jnp.broadcast_to(
        jnp.asarray(w, jnp.float32), (b,))
    return x, ok, u, wv


@functools.partial(jax.jit, static_argnames=("temperature", "block_v", "block_b", "interpret",
                                             "platform"))
def relaxed_acceptance(
    target_logits: jax.Array,  # f32|bf16[B, K+1, V] raw target logits
    draft: jax.Array,  # i32[B, K]
    q: jax.Array | None,  # f32[B, K, V] draft probabilities | None (one-hot draft)
    valid: jax.Array | None = None,  # bool[B, K] | None (all drafted)
    w: jax.Array | float | None = None,  # f32 scalar | f32[B] | None (= 1, lossless)
    uniforms: jax.Array | None = None,  # f32[B, K] in [0, 1) (sampling)
    gumbel: jax.Array | None = None,  # f32[B, V] standard Gumbel noise (sampling)
    *,
    temperature: float,
    block_v: int | None = None,
    block_b: int | None = None,
    interpret: bool | None = None,
    platform: str | None = None,
) -> Acceptance:
    """Acceptance of K drafted tokens and the next token, fused over vocabulary tiles (Pallas).

    Args:
      target_logits: target logits at the K drafted positions and the one after them.
      draft: drafted tokens x_1..x_K.
      q: the draft distributions q_i, processed like p (same temperature); None for a
        deterministic draft (q_i is one-hot at x_i).
      valid: False where the drafter proposed nothing: rejected, and the token there is drawn
        from p (q counts as 0).
      w: DIVERSED weight on the target, ν = w·p + (1 - w)·q; None (or 1) is lossless.
      uniforms: u_i of the acceptance tests (accept iff u_i·q(x_i) < ν(x_i)).
      gumbel: Gumbel(0, 1) noise for the residual / bonus sample (Gumbel-max).
      temperature: static; 0 is greedy (uniforms and gumbel unused), else >= MIN_TEMPERATURE
        (1e-6; smaller ones raise ValueError). Top-k/top-p and smaller temperatures are not
        supported: apply them in the jnp path (`jspec.verify` falls back to it).
      block_v: static tuning knob; vocabulary entries per tile (default from the tuning table).
      block_b: static tuning knob; batch rows per grid step (must divide B). Default from the
        tuning table: 1 on a device (the residual pass then reads only position n), up to 256
        in interpret mode (whose cost is per grid step).
      interpret: static; Pallas interpret mode. Default: True in a program compiled for CPU,
        False elsewhere. Not interpreted on a GPU, the Mosaic GPU kernels (`kernel_mgpu.py`) run;
        there
        `block_v` must be a multiple of 512 (default `pick_block_v_gpu`) and `block_b` is read as
        the number of vocabulary splits per row (default: about 264 CTAs in all).
      platform: static; "cpu" | "gpu" | "tpu", the platform the calling program is compiled
        for. None: decided when the program is lowered (`lax.platform_dependent`), never from
        the host's default backend.

    Returns:
      Acceptance(n_accepted i32[B], next_token i32[B], accept_prob f32[B, K]).
    """
    _check_inputs(target_logits, draft, q, valid, w, uniforms, gumbel, temperature)
    return dispatch(lambda mode: _relaxed_acceptance(
        target_logits, draft, q, valid, w, uniforms, gumbel, temperature, block_v, block_b,
        mode), interpret, platform)


def _relaxed_acceptance(target_logits, draft, q, valid, w, uniforms, gumbel, temperature,
                        block_v, block_b, mode: str) -> Acceptance:
    """`relaxed_acceptance` in one mode ("interpret" | "gpu" | "tpu")."""
    b, k1, v = target_logits.shape
    k = k1 - 1
    interpret = mode == "interpret"
    if mode == "gpu":
        x, ok, u, wv = _common(draft, valid, w, uniforms, b, k)
        n, tok, prob = relaxed_acceptance_mgpu(
            target_logits, x, q, ok, u, wv, gumbel, temperature=float(temperature),
            block_v=pick_block_v_gpu(v) if block_v is None else int(block_v),
            num_splits=block_b, weighted=w is not None)
        return Acceptance(n, tok, prob)
    tv = pick_block_v(v) if block_v is None else int(block_v)
    bb = pick_block_b(b, bool(interpret)) if block_b is None else int(block_b)
    if tv < 1 or bb < 1 or b % bb:
        raise ValueError(f"block_v ({tv}) must be >= 1 and block_b ({bb}) must divide B ({b})")
    nv = pl.cdiv(v, tv)
    greedy = temperature == 0
    weighted = w is not None
    one_hot = q is None
    x, ok, u, wv = _common(draft, valid, w, uniforms, b, k)
    i32, f32 = jnp.int32, jnp.float32

    def rows(width):  # [bb, width, 1] per-row vectors
        return pl.BlockSpec((bb, width, 1), lambda bi, *_: (bi, 0, 0))

    in_specs = [pl.BlockSpec((bb, k1, tv), lambda bi, ph, ji: (bi, 0, ji))]
    inputs = [target_logits]
    if not one_hot:
        in_specs.append(pl.BlockSpec((bb, k, tv), lambda bi, ph, ji: (bi, 0, ji)))
        inputs.append(q)
    in_specs += [rows(k), rows(k), rows(k), rows(1)]
    inputs += [x[..., None], ok[..., None], u[..., None], wv[:, None, None]]
    out_shape = [jax.ShapeDtypeStruct((b, 1, 1), i32), jax.ShapeDtypeStruct((b, 1, 1), i32),
                 jax.ShapeDtypeStruct((b, k, 1), f32), jax.ShapeDtypeStruct((b, 1, 1), f32),
                 jax.ShapeDtypeStruct((b, 1, 1), i32), jax.ShapeDtypeStruct((b, 1, 1), i32)]
    out_specs = [rows(1), rows(1), rows(k), rows(1), rows(1), rows(1)]
    scratch = [pltpu.VMEM((bb, k1, 1), f32), pltpu.VMEM((bb, k1, 1), f32),
               pltpu.VMEM((bb, k1, 1), i32), pltpu.VMEM((bb, k, 1), f32),
               pltpu.VMEM((bb, k, 1), f32), pltpu.VMEM((bb, k, 1), f32),
               pltpu.VMEM((bb, k, 1), i32)]
    phases = 2 if (greedy and weighted) else 1

    def stats_kernel(*refs):
        if one_hot:  # keep the kernel's ref order: no q_ref
            refs = (refs[0], None, *refs[1:])
        _stats_kernel(*refs, temperature=float(temperature), vocab=v, block_v=tv,
                      num_drafts=k, one_hot=one_hot, weighted=weighted)

    n, tok, prob, lse_n, prop, xn = pl.pallas_call(
        stats_kernel,
        grid=(b // bb, phases, nv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="relaxed_acceptance_stats",
    )(*inputs)
    n, tok, prob = n[:, 0, 0], tok[:, 0, 0], prob[..., 0]
    if greedy:
        return Acceptance(n, tok, prob)

    # The residual pass reads one position per row. With one row per grid step the index map
    # fetches exactly that position's tiles (scalar prefetch of its flat row); with bb rows per
    # step the rows want different positions, so the block holds all K+1 and the kernel selects.
    qn = jnp.minimum(n, k - 1)
    ridx = jnp.arange(b, dtype=i32)
    if bb == 1:
        zrow, qrow = ridx * k1 + n, ridx * k + qn
        z_in, q_in = target_logits.reshape(b * k1, 1, v), None if one_hot else q.reshape(b * k, 1, v)
        z_spec = pl.BlockSpec((1, 1, tv), lambda bi, ji, zr, qr: (zr[bi], 0, ji))
        q_spec = pl.BlockSpec((1, 1, tv), lambda bi, ji, zr, qr: (qr[bi], 0, ji))
        sel = jnp.stack([jnp.zeros_like(n), jnp.zeros_like(n), prop[:, 0, 0]], axis=1)
    else:
        zrow = qrow = ridx  # unused by the index maps
        z_in, q_in = target_logits, q
        z_spec = pl.BlockSpec((bb, k1, tv), lambda bi, ji, *_: (bi, 0, ji))
        q_spec = pl.BlockSpec((bb, k, tv), lambda bi, ji, *_: (bi, 0, ji))
        sel = jnp.stack([n, qn, prop[:, 0, 0]], axis=1)
    r_in_specs = [z_spec] + ([] if one_hot else [q_spec]) + [
        pl.BlockSpec((bb, 3, 1), lambda bi, ji, *_: (bi, 0, 0)),
        pl.BlockSpec((bb, 1, 1), lambda bi, ji, *_: (bi, 0, 0)),
        pl.BlockSpec((bb, 1, tv), lambda bi, ji, *_: (bi, 0, ji)),
        pl.BlockSpec((bb, 1, 1), lambda bi, ji, *_: (bi, 0, 0))]
    r_inputs = [z_in] + ([] if one_hot else [q_in]) + [
        sel[..., None], xn, gumbel.astype(f32).reshape(b, 1, v), lse_n]

    def residual_kernel(*refs):
        if one_hot:
            refs = (*refs[:3], None, *refs[3:])
        _residual_kernel(*refs, temperature=float(temperature), vocab=v, block_v=tv,
                         one_hot=one_hot)

    tok = pl.pallas_call(
        residual_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b // bb, nv),
            in_specs=r_in_specs,
            out_specs=pl.BlockSpec((bb, 1, 1), lambda bi, ji, *_: (bi, 0, 0)),
            scratch_shapes=[pltpu.VMEM((bb, 1, 1), f32), pltpu.VMEM((bb, 1, 1), i32),
                            pltpu.VMEM((bb, 1, 1), f32), pltpu.VMEM((bb, 1, 1), i32),
                            pltpu.VMEM((bb, 1, 1), f32)]),
        out_shape=jax.ShapeDtypeStruct((b, 1, 1), i32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="relaxed_acceptance_residual",
    )(zrow, qrow, *r_inputs)
    return Acceptance(n, tok[:, 0, 0], prob)
