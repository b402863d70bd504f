"""Which platform a program is compiled for, and code that follows it (never the host's).

A jitted program is traced once and lowered for the devices of its inputs' shardings, which
need not be the host's: `jax.jit(f).lower(<ShapeDtypeStructs on a TPU topology>)` on a CPU
machine compiles for TPU. So backend-specific code is chosen one of two ways:
  - `target()`: the platform known at trace time — from `compiling_for(...)` (set by
    `generate` from its mesh or its concrete inputs' devices), else from the abstract mesh of
    the trace (`jax.set_mesh`), else None. Shape decisions (cache capacity rounding) use it.
  - `choose(...)`: a branch per platform. With a known `target()` the branch is called
    directly; otherwise every branch is traced and `lax.platform_dependent` keeps the one for
    the platform the program is lowered for (the others are never lowered: a CPU-only custom
    call in an unused branch does not reach the TPU compiler).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
from jax import lax

PLATFORMS = ("cpu", "gpu", "tpu")
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("jspec_target", default=None)


def normalize(platform: str) -> str:
    """"cpu" | "gpu" | "tpu" for a JAX platform name ("cuda" and "rocm" are "gpu")."""
    p = platform.lower()
    return "gpu" if p in ("cuda", "rocm", "gpu") else p


def of_devices(devices: Iterable[Any]) -> str | None:
    """The one platform of `devices` (None for none; an error for a mix)."""
    found = {normalize(d.platform) for d in devices}
    if len(found) > 1:
        raise ValueError(f"devices of several platforms in one program: {sorted(found)}")
    return found.pop() if found else None


def of_mesh(mesh: Any) -> str | None:
    """The platform of a `Mesh` or `AbstractMesh` (None for an empty or absent one)."""
    if mesh is None or getattr(mesh, "empty", False):
        return None
    if isinstance(mesh, jax.sharding.Mesh):
        return of_devices(mesh.devices.flat)
    # An AbstractMesh carries its devices' platform (`abstract_device`, jax >= 0.7).
    dev = getattr(mesh, "abstract_device", None)
    p = getattr(dev, "platform", None) or getattr(mesh, "platform", None)
    return normalize(p) if p else None


def of_arrays(tree: Any) -> str | None:
    """The platform of the concrete arrays (or sharded ShapeDtypeStructs) in `tree`; None when
    it holds none (tracers inside a user's jit carry no devices)."""
    for a in jax.tree.leaves(tree):
        if isinstance(a, jax.core.Tracer):
            continue
        sh = getattr(a, "sharding", None)
        if isinstance(sh, jax.sharding.Sharding):
            return of_devices(sh.device_set)
    return None


def target() -> str | None:
    """The platform this trace is for, when known at trace time (see the module doc)."""
    t = _TARGET.get()
    if t is not None:
        return t
    return of_mesh(jax.sharding.get_abstract_mesh())


@contextlib.contextmanager
def compiling_for(platform: str | None) -> Iterator[None]:
    """Within: `target()` is `platform` (None leaves it to the trace's abstract mesh)."""
    if platform is not None and platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS} or None, got {platform!r}")
    tok = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(tok)


def choose(*args: Any, default: Callable[..., Any] | None = None, cpu: Callable[..., Any] | None = None,
           gpu: Callable[..., Any] | None = None, tpu: Callable[..., Any] | None = None) -> Any:
    """`branch(*args)` for the platform the program runs on (`default` where none is given;
    with no default that is an error). Branches must return the same shapes and dtypes. With
    no known `target()`, a branch whose trace-time checks refuse these inputs (a kernel's
    ValueError) is left out: lowering for its platform is then an error, and the other
    platforms are unaffected."""
    branches = {"cpu": cpu, "gpu": gpu, "tpu": tpu}
    t = target()
    if t is not None:
        f = branches.get(t) or default
        if f is None:
            raise ValueError(f"no implementation of this step for platform {t!r}")
        return f(*args)
    given = {}
    for name, f in branches.items():
        if f is None:
            continue
        try:
            jax.eval_shape(f, *args)
        except (ValueError, NotImplementedError):  # JspecError is a ValueError
            continue
        given[name] = f
    if not given and default is not None:
        return default(*args)
    if not given:
        raise ValueError("no platform takes this step: every branch refused its inputs")
    if "gpu" in given:
        given["cuda"] = given["rocm"] = given.pop("gpu")
    if default is not None:
        given["default"] = default
    return lax.platform_dependent(*args, **given)
