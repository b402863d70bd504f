"""TPU generations and topologies: the published facts a modelled time is built from.

One table, the only place these numbers live. Per chip, from Google Cloud's TPU system
architecture pages: HBM capacity, HBM bandwidth, peak dense bfloat16 throughput. Every time
computed from them is *modelled* (a roofline), never measured.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jspec.errors import JspecError


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str  # the generation as a topology names it: "v5e", "v6e", "v5p", "v4"
    hbm_bytes: int  # HBM per chip
    hbm_bytes_per_s: float  # HBM bandwidth per chip
    bf16_flops_per_s: float  # peak dense bfloat16 throughput per chip


GIB = 1 << 30
CHIPS = {
    "v4": Chip("v4", 32 * GIB, 1228e9, 275e12),
    "v5e": Chip("v5e", 16 * GIB, 819e9, 197e12),
    "v5p": Chip("v5p", 95 * GIB, 2765e9, 459e12),
    "v6e": Chip("v6e", 32 * GIB, 1640e9, 918e12),
}


def chip_of(topology: str) -> Chip:
    """The chip of a topology name such as "v5e:2x4" or "v5p:2x2x2"."""
    gen = topology.split(":", 1)[0].lower()
    if gen not in CHIPS:
        raise JspecError(f"unknown TPU generation {gen!r} in {topology!r}; known: {sorted(CHIPS)}")
    return CHIPS[gen]


@functools.cache
def tpu_devices(topology: str) -> tuple[jax.Device, ...]:
    """The devices of a real TPU slice, from libtpu's topology description (no TPU needed):
    "v5e:1x1", "v6e:1x1" (single chips), "v5e:2x4" (8 chips, 2 hosts), "v5e:4x4" (16 chips,
    4 hosts), "v5p:2x2x2", ..."""
    try:
        from jax.experimental import topologies  # noqa: PLC0415 (needs libtpu to be useful)
    except ImportError as e:  # pragma: no cover
        raise JspecError(f"jax.experimental.topologies is unavailable: {e}") from e
    chip_of(topology)
    dims = topology.split(":", 1)[1].split("x") if ":" in topology else []
    kw = {"chips_per_host_bounds": (1, 1, 1)} if dims and all(d == "1" for d in dims) else {}
    try:
        desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", **kw)
    except Exception as e:  # libtpu missing or the name unknown to it
        raise JspecError(f"cannot describe TPU topology {topology!r} ({type(e).__name__}: {e}); "
                         "is libtpu installed (pip install -e '.[tpu]')?") from e
    return tuple(desc.devices)


def tpu_mesh(topology: str, model: int | None = None) -> jax.sharding.Mesh:
    """A ("data", "model") mesh over the slice: `model` chips per tensor-parallel group
    (default: all of them), the rest data-parallel."""
    devs = tpu_devices(topology)
    n = len(devs)
    model = n if model is None else model
    if model < 1 or n % model:
        raise JspecError(f"model={model} must divide the {n} chips of {topology}")
    arr = np.array(devs, dtype=object).reshape(n // model, model)
    return jax.sharding.Mesh(arr, ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
