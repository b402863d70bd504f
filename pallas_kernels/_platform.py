"""How a kernel wrapper picks its implementation from the platform it is compiled for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax

MODES = ("interpret", "gpu", "tpu")


def mode_of(interpret: bool | None, platform: str | None) -> str | None:
    """"interpret" | "gpu" | "tpu", or None when only lowering can tell (no `platform` given and
    `interpret` None or False). `platform` ("cpu" | "gpu" | "tpu") is the platform the calling
    program is compiled for; CPU runs Pallas only in interpret mode."""
    if interpret:
        return "interpret"
    if platform is None:
        return None
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"platform must be 'cpu', 'gpu', 'tpu' or None, got {platform!r}")
    if platform == "cpu" and interpret is False:
        raise ValueError("Pallas kernels run on CPU only in interpret mode (interpret=False "
                         "with platform='cpu')")
    return "interpret" if platform == "cpu" else platform


def dispatch(run: Callable[[str], Any], interpret: bool | None, platform: str | None) -> Any:
    """run(mode) for the mode `mode_of` gives; when only lowering can tell, every possible mode
    is traced and `lax.platform_dependent` keeps the one of the platform lowered for (never the
    host's default backend). A device mode whose trace-time checks refuse these inputs (e.g.
    the GPU kernel and float32) is left out: lowering for that platform is then an error, and
    the other platforms are unaffected."""
    mode = mode_of(interpret, platform)
    if mode is not None:
        return run(mode)
    branches: dict[str, Callable[[], Any]] = {}
    if interpret is None:
        branches["cpu"] = lambda: run("interpret")
    refused = []
    for m, names in (("tpu", ("tpu",)), ("gpu", ("cuda", "rocm"))):
        try:
            jax.eval_shape(lambda m=m: run(m))
        except (ValueError, NotImplementedError) as e:
            refused.append(f"{m}: {e}")
            continue
        for name in names:
            branches[name] = lambda m=m: run(m)
    if not branches:
        raise ValueError("no platform takes this kernel call: " + "; ".join(refused))
    return lax.platform_dependent(**branches)


def device_kind() -> str:
    """The device kind a kernel is tuned for: the trace's abstract mesh's (`jax.set_mesh`, e.g.
    a TPU topology compiled from a CPU host), else the first local device's."""
    mesh = jax.sharding.get_abstract_mesh()
    dev = None if mesh.empty else getattr(mesh, "abstract_device", None)
    kind = getattr(dev, "device_kind", None)
    if kind:
        return str(kind)
    try:
        return jax.devices()[0].device_kind
    except RuntimeError:
        return ""
