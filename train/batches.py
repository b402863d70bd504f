"""Batches of a drafter training run (`train.data.Batch`): a pure function of (seed, step), so a
resumed run draws the batches the uninterrupted one would have; placed on a mesh with rows over
`data`, each process building only its own rows when the mesh spans several."""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jspec import sharding
from jspec.drafters.trained import DrafterConfig
from train.data import Batch, Rows, make_batch, sample_positions, window
from train.recipes import RECIPES


def batch_sharding(mesh: Mesh, batch: Any) -> Any:
    """Rows of every batch array over `data` (the rules table's `batch`), the rest replicated:
    NamedShardings in the pytree structure of `batch` (a `Batch`)."""
    return sharding.state_sharding(batch, mesh, batch=np.shape(batch.lens)[0])


def to_device(mesh: Mesh | None, batch: Batch) -> Batch:
    """A host batch on the devices: as it is without a mesh, else rows over `data`."""
    if mesh is None:
        return jax.tree.map(jnp.asarray, batch)
    return sharding.place(batch, batch_sharding(mesh, batch))


def positions(args: argparse.Namespace, kind: str, rng: np.random.Generator, lens: np.ndarray,
              plens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pos i32[B, N], valid bool[B, N]): the chain starts / anchors of a batch's rows."""
    r = RECIPES[kind]
    return sample_positions(rng, lens, plens, getattr(args, r.count), *r.window)


def plan_entry(args: argparse.Namespace, plan: list, step: int) -> tuple[int, int, int, list[int]]:
    """(epoch, index in the epoch, sequence bucket, row indices) of batch `step`: each epoch
    visits the plan in a permutation drawn from (seed, epoch)."""
    epoch, i = divmod(step, len(plan))
    seq, idx = plan[np.random.default_rng([args.seed, epoch]).permutation(len(plan))[i]]
    return epoch, i, seq, idx


def batch_for_step(args: argparse.Namespace, rows: Rows, plan: list, step: int,
                   feat_idx: list[int], cfg: DrafterConfig, part: np.ndarray | None = None
                   ) -> Batch:
    """Batch `step` of the run: a pure function of (seed, step) (resumable, deterministic).

    `part` (row indices into the batch, e.g. `sharding.process_rows`): build only those rows —
    the same rows as in the whole batch (positions are drawn for every row from the lengths,
    then cut), without assembling the others' tokens and features.
    """
    epoch, i, seq, idx = plan_entry(args, plan, step)
    kept = [window(len(rows.tokens[r]), rows.plens[r], seq) for r in idx]
    lens = np.asarray([min(len(rows.tokens[r]), seq) for r in idx], np.int32)
    plens = np.asarray([p for _, p in kept], np.int32)
    rng = np.random.default_rng([args.seed, epoch, i, 1])
    pos, valid = positions(args, cfg.kind, rng, lens, plens)
    part = np.arange(len(idx)) if part is None else np.asarray(part)
    return make_batch(rows, [idx[j] for j in part], seq, feat_idx).at(pos[part], valid[part])


def step_batch(args: argparse.Namespace, rows: Rows, plan: list, step: int, feat_idx: list[int],
               cfg: DrafterConfig, mesh: Mesh | None) -> Batch:
    """Batch `step` on the devices. On a mesh spanning several processes each process builds
    only the rows its own devices hold and the global batch is assembled from those parts
    (`sharding.place_rows`); otherwise the whole batch is placed."""
    if mesh is None or jax.process_count() == 1:
        return to_device(mesh, batch_for_step(args, rows, plan, step, feat_idx, cfg))
    size = len(plan_entry(args, plan, step)[3])
    part = sharding.process_rows(mesh, size)
    return sharding.place_rows(batch_for_step(args, rows, plan, step, feat_idx, cfg, part), mesh,
                               size)


