"""What differs between training EAGLE-3 and DFlash drafters: one `Recipe` per kind (`RECIPES`).

The loop, losses, data, evaluation and checkpointing are one code path for every kind
(`train.losses`, `train.batches`, `train.evaluation`, `train.loop`); a recipe says how the
drafter's hidden states are computed at training time (training-time test for EAGLE-3, blocks at
anchors for DFlash), the loss weight by draft position, where positions are sampled, the config
fields its flags set, and its own flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters import dflash, eagle3
from jspec.drafters.trained import DrafterConfig, Params
from train.data import eagle_layers


def _eagle3_hidden(cfg: DrafterConfig, p: Params, embed: jax.Array, tokens: jax.Array,
                   feats: jax.Array, start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Training-time test from every position; kept at the sampled chain starts s: hidden
    states f32[B, N, K, D] and the positions i32[B, N, K] they predict (step j: s + j + 1)."""
    steps = cfg.block
    hs = eagle3.train_forward(cfg, p, embed, tokens, feats, steps)
    hsel = jnp.stack([jnp.take_along_axis(h, start[..., None], axis=1) for h in hs], 2)
    return hsel, start[..., None] + jnp.arange(2, steps + 2)[None, None]


def _dflash_hidden(cfg: DrafterConfig, p: Params, embed: jax.Array, tokens: jax.Array,
                   feats: jax.Array, anchors: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Blocks at the sampled anchors a: hidden states f32[B, M, γ-1, D] (block slot k
    predicts token a + k) and those positions i32[B, M, γ-1]."""
    gamma = cfg.block
    h = dflash.train_forward(cfg, p, embed, tokens, feats, anchors, gamma)
    return h[:, :, 1:], anchors[..., None] + jnp.arange(1, gamma)[None, None]


def _eagle3_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="training-time-test steps (unrolled on own predictions)")
    p.add_argument("--positions", type=int, default=128,
                   help="chain starts sampled per sequence per step")


def _dflash_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=2, help="drafter layers")
    p.add_argument("--block", type=int, default=8, help="block size γ (anchor + γ-1)")
    p.add_argument("--anchors", type=int, default=48,
                   help="anchors (blocks) sampled per sequence per step")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What differs between training the trained drafters; the loop, losses, data, eval and
    checkpointing are one code path for all (`RECIPES[kind]`; the kind's constructor,
    parameters and initialiser: `jspec.drafters.kinds`)."""

    hidden: Callable[..., tuple[jax.Array, jax.Array]]  # (cfg, p, embed, tokens, feats, pos)
    decay: Callable[[jax.Array], jax.Array]  # loss weight by 0-based draft index
    window: tuple[int, int]  # sample_positions' (lo, hi): where positions may sit
    count: str  # the argument giving positions sampled per sequence
    shape: Callable[[argparse.Namespace, tuple[int, ...]], dict[str, Any]]  # config fields
    add_args: Callable[[argparse.ArgumentParser], None]
    ffn: int  # default MLP width
    replay_chunk: int | None = None  # positions per `greedy_drafts` call (None: all at once)


DEFAULT_DRAFT_VOCAB = 4096  # covers 87% of the corpus' response tokens (docs/BENCHMARKS.md)

RECIPES: dict[str, Recipe] = {
    # Chain starts s >= plen - 2 (step 1 predicts s + 2 >= plen); weights 0.8^k.
    "eagle3": Recipe(_eagle3_hidden, lambda k0: 0.8 ** k0, (-2, 3),
                     "positions",
                     lambda a, rec: {"num_layers": 1, "feature_layers": eagle_layers(rec),
                                     "block": a.ttt_steps},
                     _eagle3_args, 1536),
    # Anchors a >= plen (the first generated token) with a + 1 < len; weights exp(-k/7).
    "dflash": Recipe(_dflash_hidden, lambda k0: jnp.exp(-k0 / 7.0), (0, 2),
                     "anchors",
                     lambda a, rec: {"num_layers": a.layers, "feature_layers": rec,
                                     "block": a.block},
                     _dflash_args, 1024, replay_chunk=64),  # 64 blocks of γ queries a call
}


def base_weight(kind: str, k0: jax.Array) -> jax.Array:
    """Position weights by 0-based draft index: 0.8^k (EAGLE-3), exp(-k/7) (DFlash)."""
    return RECIPES[kind].decay(k0)


