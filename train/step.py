"""A trained drafter's optimizer step as a pure, jittable function of a rollout (issue 58 item
6): `generate(..., features=True)` returns the target's features of the tokens it committed;
`rollout_batch` turns that output into the batch `train_step` reads (the layout
`train.featurize` writes, built on the device); `drafter_step` takes an EAGLE-3 / DFlash drafter
object, an optax state and the rollout, and returns the updated drafter. Nothing leaves the
device, so an RL step can roll out, update the policy, re-bind and train its drafter inside
one `jax.jit`:

    tx = optax.adamw(1e-4)
    opt = init_opt(drafter, tx)

    @jax.jit
    def step(weights, drafter, opt, key):
        out = jspec.generate(model_with(weights), ids, lens, drafter=drafter, key=key,
                             sampling=jspec.Sampling(1.0), features=True, ...)
        drafter, opt, metrics = drafter_step(drafter, opt, out, lens, key, tx=tx)
        return out, drafter, opt, metrics
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters.trained import Frozen, Params, split_frozen, with_stats
from jspec.errors import JspecError
from jspec.state import GenerateOutput
from train.data import Batch
from train.drafters import RECIPES, train_step


def params_of(drafter: Any) -> tuple[Params, Frozen]:
    """(the trained parameters, what training holds fixed) of an EAGLE-3 / DFlash drafter:
    jittable (`Frozen.of` builds the vocabulary map on the host)."""
    kind = getattr(getattr(drafter, "cfg", None), "kind", None)
    if kind not in RECIPES:
        raise JspecError(f"drafter_step trains EAGLE-3 and DFlash drafters, got "
                         f"{getattr(drafter, 'name', type(drafter).__name__)!r}")
    params, stats = split_frozen(drafter.params)
    vd = drafter.vocab_ids.shape[0]
    to_draft = jnp.full((drafter.embed.shape[0],), -1, jnp.int32).at[drafter.vocab_ids].set(
        jnp.arange(vd, dtype=jnp.int32))
    frozen = Frozen(embed=drafter.embed.astype(jnp.float32),
                    head=drafter.head.astype(jnp.float32), to_draft=to_draft, stats=stats)
    return params, frozen


def init_opt(drafter: Any, tx: Any) -> Any:
    """The optax state for `drafter_step` (over the trained parameters only)."""
    return tx.init(params_of(drafter)[0])


def rollout_batch(out: GenerateOutput, prompt_lengths: jax.Array, key: jax.Array, *,
                  kind: str, positions: int) -> Batch:
    """`train_step`'s batch from a `generate(..., features=True)` output.

    Args:
      out: with `sequence` i32[B, W], `features` f32[B, W, F, D], `final_hidden` f32[B, W, D].
      prompt_lengths: i32[B] the prompts' real lengths.
      key: draws the positions.
      kind: "eagle3" or "dflash" (the recipe's window of positions).
      positions: static; positions (chain starts / block anchors) per row.
    Returns:
      a `train.data.Batch` with pos i32[B, positions] and valid bool[B, positions]:
      positions drawn uniformly without replacement from the recipe's window [plen + lo, len -
      hi] as `train.data.sample_positions` draws them (fewer, valid first, when the window is
      short), sorted.
    """
    if out.features is None:
        raise JspecError("rollout_batch needs generate(..., features=True)")
    lo_off, hi_off = RECIPES[kind].window
    b, w = out.sequence.shape
    lens = (prompt_lengths + out.lengths).astype(jnp.int32)
    lo, hi = prompt_lengths + lo_off, lens - hi_off
    j = jnp.arange(w, dtype=jnp.int32)[None, :]
    score = jnp.where((j >= lo[:, None]) & (j <= hi[:, None]),
                      jax.random.uniform(key, (b, w)), 2.0)
    _, idx = jax.lax.top_k(-score, positions)  # the `positions` smallest scores
    picked = jnp.take_along_axis(score, idx, axis=1) < 2.0
    srt = jnp.sort(jnp.where(picked, idx, w), axis=1)
    valid = srt < w
    return Batch(tokens=out.sequence, lens=lens, plens=prompt_lengths.astype(jnp.int32),
                 feats=out.features, final=out.final_hidden,
                 pos=jnp.where(valid, srt, 0).astype(jnp.int32), valid=valid)


def drafter_step(drafter: Any, opt_state: Any, out: GenerateOutput, prompt_lengths: jax.Array,
                 key: jax.Array, *, tx: Any, positions: int = 8, vat_head: bool = False,
                 vat_weight: bool = False) -> tuple[Any, Any, dict[str, jax.Array]]:
    """One optimizer step of `drafter` (EAGLE-3 / DFlash) on a rollout: `train_step` (the
    CLI's step: its loss, its optimizer update) on `rollout_batch`. Pure and jittable; `tx`
    static (an optax transformation), `positions` static.

    Returns:
      (the drafter with the updated parameters, the optax state, the step's metrics).
    """
    params, frozen = params_of(drafter)
    cfg = drafter.cfg
    batch = rollout_batch(out, prompt_lengths, key, kind=cfg.kind, positions=positions)
    params, opt_state, metrics = train_step(params, opt_state, frozen, batch, kind=cfg.kind,
                                            cfg=cfg, tx=tx, vat_head=vat_head,
                                            vat_weight=vat_weight)
    return dataclasses.replace(drafter, params=with_stats(params, frozen.stats)), opt_state, metrics
