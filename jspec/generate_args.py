"""The arguments of a `generate` call checked and shaped on the host, before the jitted entry
(`jspec.decode`): the dynamic per-row values (`limit=`, `stop_ids=`, `sampling_params=`) as
arrays of one shape per batch, so that other values compile nothing; `features=` as its static
layers; `mesh=` inside a user's trace.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jspec.errors import JspecError
from jspec.models.config import ModelConfig
from jspec.sampling import Sampling, SamplingParams


def limit_rows(limit: Any, batch: int) -> jax.Array | None:
    """`limit=` as i32[B] (a scalar is broadcast, so that both compile one program; None
    stays None: the static maximum)."""
    if limit is None:
        return None
    limit = jnp.asarray(limit, jnp.int32)
    if limit.ndim > 1 or (limit.ndim == 1 and limit.shape[0] != batch):
        raise JspecError(f"limit must be a scalar or one value per row ({batch}), got shape "
                         f"{limit.shape}")
    return jnp.broadcast_to(limit, (batch,))


def feature_layers(features: Any, drafter: Any, config: ModelConfig) -> tuple[int, ...]:
    """`features=` as the static tuple of target layers whose hidden states are returned
    (() when off): True means the drafter's own feature layers; a tuple must equal them when
    the drafter has some (its forwards compute those)."""
    if features is False or features is None:
        return ()
    own = () if drafter is None else tuple(getattr(drafter.caps, "feature_layers", ()))
    if features is True:
        if not own:
            raise JspecError("features=True returns the drafter's feature layers and this "
                             "decoding has none: pass features=(layer, ...) (target layers)")
        return own
    layers = tuple(int(i) for i in features)
    if not layers or any(not 0 <= i < config.num_layers for i in layers):
        raise JspecError(f"features must be True or target layer indices in [0, "
                         f"{config.num_layers}), got {features!r}")
    if own and layers != own:
        raise JspecError(f"this drafter's forwards return layers {own}: pass features=True "
                         f"(or features={own}), got {layers}")
    return layers


def sampling_rows(params: SamplingParams | None, sampling: Sampling, batch: int
                     ) -> SamplingParams | None:
    """`sampling_params=` checked against the static `sampling`, each given field as f32[B] /
    i32[B] (a scalar is broadcast, so that both compile one program)."""
    if params is None:
        return None
    sampling.check_rows(params)

    def rows(a: Any, dtype: Any, name: str) -> jax.Array | None:
        if a is None:
            return None
        a = jnp.asarray(a, dtype)
        if a.ndim > 1 or (a.ndim == 1 and a.shape[0] != batch):
            raise JspecError(f"sampling_params.{name} must be a scalar or one value per row "
                             f"({batch}), got shape {a.shape}")
        return jnp.broadcast_to(a, (batch,))

    return SamplingParams(temperature=rows(params.temperature, jnp.float32, "temperature"),
                          top_k=rows(params.top_k, jnp.int32, "top_k"),
                          top_p=rows(params.top_p, jnp.float32, "top_p"))


def stop_array(stop_ids: Any) -> jax.Array | None:
    """`stop_ids=` as i32[S] (None stays None: the model's static `eos_ids`)."""
    if stop_ids is None:
        return None
    stop = jnp.asarray(stop_ids, jnp.int32)
    if stop.ndim != 1 or stop.shape[0] == 0:
        raise JspecError(f"stop_ids must be a non-empty i32[S] array (pad with -1), got shape "
                         f"{stop.shape}")
    return stop


def in_user_trace() -> bool:
    """True when `generate` is called inside a trace (a user's jit, vmap, scan, ...):
    `jax.sharding.get_mesh` answers only outside one."""
    try:
        jax.sharding.get_mesh()
    except ValueError:
        return True
    return False


def check_mesh_argument(mesh: Mesh | bool | None, traced: bool) -> None:
    """`mesh=` None inside a user's jit under a `jax.set_mesh` context is an error that names
    both choices (a Mesh, or False: pin nothing)."""
    if mesh is True:
        raise JspecError("mesh must be a jax.sharding.Mesh, None or False, got True")
    if mesh is None and traced:
        ctx = jax.sharding.get_abstract_mesh()
        explicit = any(t == jax.sharding.AxisType.Explicit for t in ctx.axis_types)
        if not ctx.empty and not explicit:  # Explicit: sharding.resolve_mesh's own error
            raise JspecError(
                f"generate inside your jit under a jax.set_mesh context (axes "
                f"{ctx.axis_names}): jspec cannot read the concrete mesh there; pass mesh=<that "
                f"Mesh> to lay the decode out by jspec.sharding.RULES, or mesh=False to pin "
                f"nothing (XLA propagates your inputs' shardings)")
