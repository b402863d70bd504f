"""The drafters' training loss: soft CE against the target's distribution restricted to the draft
vocabulary (recomputed from the cached final hidden state through the shared LM head) + hard CE
against the target's token, weighted by draft position (`recipes.Recipe.decay`); with VAT the
verification head's BCE and the weights restarted at the first simulated rejection."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters.trained import (
    DrafterConfig,
    Frozen,
    Params,
    cast_matrices,
    draft_logits,
    verify_head,
    with_stats,
)
from jspec.models.blocks import dense
from train.data import Batch
from train.recipes import RECIPES, base_weight


def block_loss(kind: str, logits: jax.Array, t_logits: jax.Array, hard: jax.Array,
               valid: jax.Array, vh: jax.Array, vat_head: bool, vat_weight: bool
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss over drafted blocks.

    Args (N blocks, K draft positions, Vd draft vocabulary):
      logits f32[N, K, Vd] drafter; t_logits f32[N, K, Vd] target (restricted to the draft
      vocabulary); hard i32[N, K] the target's token as a draft index (-1: not in it);
      valid bool[N, K]; vh f32[N, K] verification-head logits.
    """
    kk = logits.shape[1]
    logq = jax.nn.log_softmax(logits, axis=-1)
    pt = jax.nn.softmax(t_logits, axis=-1)
    soft = -jnp.sum(pt * logq, axis=-1)
    hard_ce = -jnp.take_along_axis(logq, jnp.maximum(hard, 0)[..., None], axis=-1)[..., 0]
    hard_ce = jnp.where(hard >= 0, hard_ce, 0.0)
    # Simulated greedy verification: draft argmax == target argmax, up to the first miss.
    match = (jnp.argmax(logits, -1) == jnp.argmax(t_logits, -1)) & valid
    run = jnp.cumprod(match.astype(jnp.int32), axis=1)  # 1 while every earlier one matched
    first_rej = jnp.sum(run, axis=1)  # [N] = k* (0-based index of the first rejection)
    k0 = jnp.arange(kk, dtype=jnp.float32)[None]
    if vat_weight:
        w = jnp.where(k0 < first_rej[:, None], 1.0,
                      base_weight(kind, k0 - first_rej[:, None].astype(jnp.float32)))
    else:
        w = jnp.broadcast_to(base_weight(kind, k0), logits.shape[:2])
    w = jax.lax.stop_gradient(w) * valid
    n_valid = jnp.maximum(jnp.sum(valid), 1)
    ce = jnp.sum(w * (soft + hard_ce)) / n_valid
    label = (k0 < first_rej[:, None]).astype(jnp.float32)
    bce = jnp.sum(valid * (jnp.logaddexp(0.0, vh) - label * vh)) / n_valid
    loss = ce + (bce if vat_head else 0.0)
    blocks = jnp.maximum(jnp.sum(valid[:, 0]), 1)
    # The metrics: decoding never accepts a token outside the draft vocabulary, so a position
    # whose text token is outside it is a miss there, even where the drafter matches the
    # target's best in-vocabulary token (on greedy text, the held-out shards, that token is the
    # target's argmax: this is decoding's greedy acceptance). The loss above keeps `match`.
    hit = match & (hard >= 0)
    hit_run = jnp.sum(jnp.cumprod(hit.astype(jnp.int32), axis=1), axis=1)
    metrics = {"loss": loss, "ce": ce, "vh_bce": bce,
               "acc1": jnp.sum(hit[:, 0]) / blocks,
               "tau_sim": 1.0 + jnp.sum(jnp.where(valid[:, 0], hit_run, 0)) / blocks}
    return loss, metrics


def forward_blocks(kind: str, cfg: DrafterConfig, params: Params, frozen: Frozen,
                   batch: Batch, matmul_dtype: Any = jnp.float32,
                   with_target_hidden: bool = False) -> tuple[jax.Array, ...]:
    """(logits, target logits, hard, valid, vh) for the sampled blocks of a batch, and with
    `with_target_hidden` the target's final hidden state f32[N, K, D] that gives each position's
    target logits (for a full-vocabulary p: `train.qtemp`).

    matmul_dtype: the operands of the drafter's matmuls and of the draft head (float32
    accumulation either way; the parameters and their gradients stay float32)."""
    tokens, lens = batch.tokens, batch.lens
    feats = batch.feats.astype(jnp.float32)
    final = batch.final.astype(jnp.float32)
    head, to_draft = frozen.head.astype(matmul_dtype), frozen.to_draft
    params = cast_matrices(with_stats(params, frozen.stats), matmul_dtype)
    s = tokens.shape[1]
    hsel, tpos = RECIPES[kind].hidden(cfg, params, frozen.embed, tokens, feats, batch.pos)
    valid = batch.valid[..., None] & (tpos < lens[:, None, None])
    tpc = jnp.minimum(tpos, s - 1)
    b, n, kk = tpc.shape
    fh = jnp.take_along_axis(final, (tpc - 1).reshape(b, n * kk)[..., None], axis=1)
    t_logits = dense(fh, head.T).reshape(b, n, kk, -1)  # target's logits for token tpos
    hard = to_draft[jnp.take_along_axis(tokens, tpc.reshape(b, n * kk), axis=1)].reshape(b, n, kk)
    logits = draft_logits(cfg, params, head, hsel)
    vh = verify_head(params, hsel)
    flat = lambda x: x.reshape((b * n, kk, *x.shape[3:]))  # noqa: E731
    out = flat(logits), flat(t_logits), flat(hard), flat(valid), flat(vh)
    return (*out, fh.reshape(b * n, kk, -1)) if with_target_hidden else out


