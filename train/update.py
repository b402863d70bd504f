"""One optimizer step of a drafter (`train_step`), its held-out metrics (`eval_step`), and the
placement of parameters, moments, frozen arrays and batch on a mesh through the rules table."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jspec import sharding
from jspec.drafters.trained import DrafterConfig, Frozen, Params
from train.batches import batch_sharding
from train.data import Batch
from train.losses import block_loss, forward_blocks


def shard_for_training(mesh: Mesh, cfg: DrafterConfig, params: Params, opt_state: Any,
                       frozen: Frozen, batch: Batch | None = None
                       ) -> tuple[Any, ...]:
    """Place the training inputs on `mesh` through the rules table.

    Parameters and optimizer moments: heads / KV heads / MLP over `model` (their fields' axes);
    the frozen target embedding and draft head: vocabulary over `model`; the batch: rows over
    `data`. Multi-host safe (every process holds the same full batch: batches are a function
    of (seed, step)).

    Returns:
      (params, opt_state, frozen[, batch]) placed.
    """
    out = (sharding.place(params, sharding.params_sharding(params, mesh, head_dim=cfg.head_dim)),
           sharding.place(opt_state, sharding.params_sharding(opt_state, mesh,
                                                              head_dim=cfg.head_dim)),
           sharding.place(frozen, sharding.params_sharding(frozen, mesh)))
    if batch is not None:
        out = (*out, sharding.place(batch, batch_sharding(mesh, batch)))
    return out


@functools.partial(jax.jit, static_argnames=("kind", "cfg", "tx", "vat_head", "vat_weight", "mesh",
                                             "matmul_dtype"),
                   donate_argnames=("params", "opt_state"))
def train_step(params: Params, opt_state: Any, frozen: Frozen,
               batch: Batch, *, kind: str, cfg: DrafterConfig, tx: Any,
               vat_head: bool, vat_weight: bool, mesh: Mesh | None = None,
               matmul_dtype: str = "float32") -> tuple[Params, Any, dict[str, jax.Array]]:
    """One optimizer step on `batch` (a `Batch` with positions).
    `mesh` (static): keep params / moments / batch in their rules-table layout
    (`shard_for_training`); the gradient all-reduce over `data` is the compiler's.
    `matmul_dtype`: "float32" or "bfloat16" operands in the forward and backward matmuls."""
    def pin(p, o):
        if mesh is None:
            return p, o
        return (sharding.constrain(p, sharding.params_sharding(p, mesh, head_dim=cfg.head_dim)),
                sharding.constrain(o, sharding.params_sharding(o, mesh, head_dim=cfg.head_dim)))

    params, opt_state = pin(params, opt_state)
    if mesh is not None:
        batch = sharding.constrain(batch, batch_sharding(mesh, batch))

    def loss_fn(p):
        out = forward_blocks(kind, cfg, p, frozen, batch, jnp.dtype(matmul_dtype))
        return block_loss(kind, *out, vat_head=vat_head, vat_weight=vat_weight)

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics["grad_norm"] = optax.global_norm(grads)
    params, opt_state = pin(params, opt_state)
    return params, opt_state, metrics


@functools.partial(jax.jit, static_argnames=("kind", "cfg"))
def eval_step(params: Params, frozen: Frozen, batch: Batch, *,
              kind: str, cfg: DrafterConfig) -> dict[str, jax.Array]:
    """`block_loss`'s metrics (with the VAT head's BCE) on a held-out batch."""
    out = forward_blocks(kind, cfg, params, frozen, batch)
    return block_loss(kind, *out, vat_head=True, vat_weight=False)[1]


