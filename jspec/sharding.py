"""Sharding on a device mesh: one table of logical axis names drives every layout.

Every array jspec shards is described by *logical* axis names, one per dimension (`("embed",
"heads")` for a q projection, `("batch", "seq", "kv_heads", "head_dim")` for a KV-cache buffer).
`RULES` maps each logical name to a mesh axis (or None: replicated). Nothing else in jspec names a
mesh axis: target weights, drafter weights, KV caches, the decode state, training batches and the
`shard_map` specs of kernels all resolve through this one table.

Mesh axes: `data` (batch rows) and `model` (heads, KV heads, MLP width, vocabulary: Megatron-style
tensor parallelism; the residual stream `embed` stays replicated). Parameters get their logical
axes from the dataclass fields that hold them (`logical`: `LayerWeights`, `Weights`, the trained
drafters' parameters); per-row state likewise (KV caches, drafter caches), else `("batch", None,
...)` when the leading dimension is the batch; anything else is replicated.
Kernels (Pallas calls) run per device through `shard_kernel` / `shard_map`, specs from `RULES`.

Axis types: jspec's meshes use `AxisType.Auto` (GSPMD/Shardy propagation), not `jax.make_mesh`'s
`Explicit` default: inputs are placed with `NamedSharding`s, the carried decode state pinned
with `with_sharding_constraint`, and the model code in between is the one-device code. An
Explicit mesh is converted (same devices and names, Auto types) by `auto_mesh`.

The divisibility rule: a logical axis is sharded over its mesh axis only when the mesh axis size
divides the array dimension — and, for flattened heads (`H*hd`), the number of heads: no head is
split. Otherwise that dimension is replicated. Example: SmolLM2-135M (9 heads, 3 KV heads) on
`model=8` keeps q/k/v/o replicated and shards MLP (1536) and vocabulary (49152).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from jspec.errors import JspecError
from jspec.memory import per_device_bytes

__all__ = ["DATA", "MODEL", "RULES", "Axes", "auto_mesh", "constrain", "declared_axes",
           "head_dim_of", "logical", "logical_spec", "make_mesh", "named", "param_specs",
           "params_sharding", "parse_mesh", "per_device_bytes", "place", "place_rows",
           "process_rows", "replicated", "resolve_mesh", "shard_drafter", "shard_kernel",
           "shard_map", "shard_model", "state_sharding", "state_specs", "to_host", "using"]

DATA = "data"  # mesh axis for batch rows (data parallelism)
MODEL = "model"  # mesh axis for heads / MLP / vocabulary (tensor parallelism)
Axes = tuple[str | None, ...]  # one logical axis name (or None) per array dimension

# The one table: logical axis name -> mesh axis name (None: replicated).
RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", DATA),
    ("heads", MODEL),  # query heads (flattened H*hd in weights)
    ("kv_heads", MODEL),  # key/value heads (weights and KV caches)
    ("mlp", MODEL),  # MLP hidden width
    ("vocab", MODEL),  # embedding rows, LM-head columns, draft-vocabulary head rows
    ("embed", None),  # the residual stream (hidden size D): replicated
    ("seq", None),  # cache slots / sequence positions
    ("head_dim", None),
)



def logical(*axes: str | None, default: Any = dataclasses.MISSING,
            stackable: bool = False) -> Any:
    """A dataclass field holding an array with these logical axes (one name or None per
    dimension): how parameters and state declare their layout. `param_specs` / `state_specs`
    read it from the field that holds a leaf (the innermost such field on its pytree path, so
    a tuple of layers or an optimizer's moments of a parameter inherit it); nothing is
    inferred from a name. `stackable`: the field may hold a stack of such arrays, one more
    leading dimension (scanned layers, [L, ...]), which is not sharded."""
    return dataclasses.field(default=default, metadata={"axes": tuple(axes),
                                                        "stackable": stackable})


# ----------------------------------------------------------------------------- meshes
def make_mesh(data: int, model: int, *, devices: Any = None) -> Mesh:
    """A `(data, model)` mesh with Auto axis types over `data * model` devices.

    Args:
      data: size of the `data` axis (batch rows).
      model: size of the `model` axis (heads / MLP / vocabulary).
      devices: default `jax.devices()` (all devices of all processes); their number must be
        `data * model`.
    Returns:
      a `jax.sharding.Mesh` with axes ("data", "model"), both `AxisType.Auto`.
    """
    devs = jax.devices() if devices is None else list(devices)
    if data < 1 or model < 1 or data * model != len(devs):
        raise JspecError(f"a {data}x{model} mesh needs {data * model} devices, there are "
                         f"{len(devs)} (jax.devices()); on CPU, fake devices come from "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=N")
    return jax.make_mesh((data, model), (DATA, MODEL), axis_types=(AxisType.Auto,) * 2,
                         devices=devs)


def parse_mesh(spec: str) -> Mesh:
    """`"DATAxMODEL"` (e.g. `"2x4"`; the command lines' `--mesh`) -> `make_mesh(DATA, MODEL)`."""
    parts = spec.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise JspecError(f"--mesh must be DATAxMODEL, e.g. 2x4, got {spec!r}")
    return make_mesh(int(parts[0]), int(parts[1]))


def auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis `AxisType.Auto` (see the module doc)."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def resolve_mesh(mesh: Mesh | None) -> Mesh | None:
    """`mesh`, else the mesh set with `jax.set_mesh` (if any), as an Auto-typed mesh; or None."""
    if mesh is None:
        if _inside_trace():  # inside a user's jit: only the abstract context mesh is visible
            _check_not_explicit()
            return None
        ctx = jax.sharding.get_mesh()
        mesh = None if ctx.empty else ctx
    if mesh is None:
        return None
    if not isinstance(mesh, Mesh):
        raise JspecError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if not {DATA, MODEL} & set(mesh.axis_names):
        raise JspecError(f"jspec shards over mesh axes named {DATA!r} and {MODEL!r} "
                         f"(jspec.sharding.make_mesh); this mesh has {mesh.axis_names}")
    return auto_mesh(mesh)


def _inside_trace() -> bool:
    """True inside `jit` (or any trace); `jax.sharding.get_mesh` only works outside one."""
    try:
        jax.sharding.get_mesh()
    except ValueError:
        return True
    return False


@contextlib.contextmanager
def using(mesh: Mesh | None) -> Iterator[None]:
    """Trace jspec's jitted functions under `mesh` (Auto axes) as the context mesh.

    Outside `jit` this is `jax.set_mesh(mesh)`, which also overrides a user's Explicit context
    mesh (whose sharding-in-types would otherwise apply to jspec's model code) and lets model
    code find the mesh (`shard_kernel`). Inside a user's `jit` the context cannot change: an
    Explicit context mesh is then an error with a remedy.
    """
    if mesh is None:
        yield
        return
    if not _inside_trace():
        with jax.set_mesh(mesh):
            yield
        return
    _check_not_explicit()
    # The context mesh cannot change inside a trace; `shard_kernel` reads this one instead, so
    # a Pallas call under `generate(mesh=...)` in a user's jit still runs per device (Mosaic
    # kernels cannot be partitioned automatically).
    tok = _KERNEL_MESH.set(mesh)
    try:
        yield
    finally:
        _KERNEL_MESH.reset(tok)


_KERNEL_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("jspec_kernel_mesh",
                                                                           default=None)


def _check_not_explicit() -> None:
    ctx = jax.sharding.get_abstract_mesh()
    if not ctx.empty and any(t == AxisType.Explicit for t in ctx.axis_types):
        raise JspecError("jspec runs its model code with Auto mesh axes; inside your own jit, "
                         "call it under a mesh built with axis_types=(AxisType.Auto, ...) "
                         "(jspec.sharding.make_mesh) and pass mesh=, or wrap the call in "
                         "jax.sharding.auto_axes")


# ----------------------------------------------------------------------------- specs
def logical_spec(axes: Axes, shape: tuple[int, ...], mesh: Mesh | AbstractMesh,
                 rules: tuple[tuple[str, str | None], ...] = RULES,
                 units: Mapping[str, int] | None = None) -> PartitionSpec:
    """The PartitionSpec of an array from its logical axes, under the divisibility rule.

    Args:
      axes: one logical name (or None) per dimension of `shape`.
      shape: the array's shape.
      mesh: a Mesh or AbstractMesh (only axis names and sizes are read).
      rules: logical name -> mesh axis (default `RULES`).
      units: logical name -> elements per unit (e.g. {"heads": head_dim} for a flattened
        H*hd dimension): the mesh axis must divide the number of units.
    Returns:
      PartitionSpec with a mesh axis where the rule applies, None elsewhere. A mesh axis is used
      at most once; mesh axes the mesh does not have are treated as size 1 (replicated).
    """
    if len(axes) != len(shape):
        raise JspecError(f"logical axes {axes} do not match shape {shape}")
    table = dict(rules)
    sizes = dict(mesh.shape)
    used: set[str] = set()
    out: list[str | None] = []
    for name, dim in zip(axes, shape, strict=True):
        target = table.get(name) if name is not None else None
        unit = (units or {}).get(name, 1) if name is not None else 1
        m = sizes.get(target, 1) if target is not None else 1
        ok = (target is not None and m > 1 and target not in used and dim % unit == 0
              and (dim // unit) % m == 0)
        out.append(target if ok else None)
        if ok:
            used.add(target)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def declared_axes(root: Any, path: tuple[Any, ...], ndim: int | None = None) -> Axes | None:
    """The logical axes declared (`logical`) by the innermost dataclass field on `path` from
    `root`, None when no field on the path declares any. With the leaf's `ndim`: a stackable
    field's leaf of one more dimension than declared gets a leading unsharded axis."""
    obj, found = root, None
    for entry in path:
        if isinstance(entry, jax.tree_util.GetAttrKey):
            if dataclasses.is_dataclass(obj):
                f = {f.name: f for f in dataclasses.fields(obj)}.get(entry.name)
                if f is not None and "axes" in f.metadata:
                    found = f.metadata
            obj = getattr(obj, entry.name)
        elif isinstance(entry, jax.tree_util.SequenceKey):
            obj = obj[entry.idx]
        elif isinstance(entry, jax.tree_util.DictKey):
            obj = obj[entry.key]
        else:  # a node flattened without names: nothing below it can be resolved
            break
    if found is None:
        return None
    axes = found["axes"]
    stacked = ndim is not None and found.get("stackable") and ndim == len(axes) + 1
    return (None, *axes) if stacked else axes


def param_specs(tree: Any, mesh: Mesh | AbstractMesh, *, head_dim: int | None = None,
                rules: tuple[tuple[str, str | None], ...] = RULES) -> Any:
    """PartitionSpecs (same pytree structure) of parameters, from their fields' declared axes.

    Args:
      tree: weights, drafter params or optimizer state (arrays or ShapeDtypeStructs).
      mesh: Mesh or AbstractMesh.
      head_dim: the head size of flattened head dimensions (`heads`, `kv_heads` in a
        parameter are H*hd wide), so that no head is split; None checks the dimension only.
    Returns:
      a pytree of PartitionSpec (replicated where no axes are declared).
    """
    units = {"heads": head_dim, "kv_heads": head_dim} if head_dim else None

    def spec(path, a):
        axes = declared_axes(tree, path, a.ndim)
        if axes is None or len(axes) != a.ndim:
            return PartitionSpec()
        return logical_spec(axes, a.shape, mesh, rules, units)

    return jax.tree_util.tree_map_with_path(spec, tree)


def state_specs(tree: Any, mesh: Mesh | AbstractMesh, *, batch: int,
                rules: tuple[tuple[str, str | None], ...] = RULES) -> Any:
    """PartitionSpecs of per-row state (decode state, caches, batches): the fields' declared
    axes, else ("batch", None, ...) for arrays whose leading dimension is `batch`, else
    replicated.
    """
    def spec(path, a):
        axes = declared_axes(tree, path, a.ndim)
        if axes is None or len(axes) != a.ndim:
            if a.ndim >= 1 and a.shape[0] == batch:
                axes = ("batch",) + (None,) * (a.ndim - 1)
            else:
                return PartitionSpec()
        return logical_spec(axes, a.shape, mesh, rules)

    return jax.tree_util.tree_map_with_path(spec, tree)


def replicated(tree: Any, mesh: Mesh) -> Any:
    """NamedShardings that replicate every array of `tree` on `mesh`."""
    return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), tree)


def named(mesh: Mesh, specs: Any) -> Any:
    """PartitionSpecs -> NamedShardings on `mesh` (same pytree structure)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


# ----------------------------------------------------------------------------- placement
def _put(x: Any, s: NamedSharding) -> Any:
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, s)
    if isinstance(x, jax.Array) and x.sharding == s:
        return x
    if s.is_fully_addressable:
        return jax.device_put(x, s)
    # Multi-host: every process holds the full value and contributes the shards its own devices
    # own (a device_put of a host array to devices of other processes is not allowed).
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _put(jax.random.key_data(x), NamedSharding(s.mesh, PartitionSpec()))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])


def place(tree: Any, shardings: Any) -> Any:
    """Put each array of `tree` on its NamedSharding (pytree of the same structure).

    Concrete arrays are transferred (a no-op when already placed; multi-host safe); traced
    values (inside a user's `jit`) get a `with_sharding_constraint` instead.
    """
    return jax.tree.map(_put, tree, shardings)


def constrain(tree: Any, shardings: Any) -> Any:
    """`with_sharding_constraint` on every array of `tree` (inside `jit`)."""
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def process_rows(mesh: Mesh, batch: int) -> np.ndarray:
    """The rows of a `batch`-row array (rows over `data` by the rules table) that this process's
    devices hold: what this process must supply to `place_rows`.

    Args:
      mesh: the mesh (it may span several processes).
      batch: the global number of rows.
    Returns:
      i64[n] sorted row indices (all rows when `batch` is replicated over `data`; `batch / D *
      local data positions` rows on a data axis of size D that divides it).
    """
    s = NamedSharding(mesh, logical_spec(("batch",), (batch,), mesh))
    rows: set[int] = set()
    for idx in s.addressable_devices_indices_map((batch,)).values():
        rows.update(range(*idx[0].indices(batch)))
    return np.asarray(sorted(rows), np.int64)


def place_rows(tree: Any, mesh: Mesh, batch: int) -> Any:
    """Global arrays of `batch` rows from this process's rows only (`process_rows`).

    Each process passes the rows its own devices hold, in `process_rows` order; the arrays are
    laid out as `state_sharding` lays out a full batch (rows over `data`), assembled with
    `jax.make_array_from_process_local_data`. No process needs the whole batch.

    Args:
      tree: arrays [len(process_rows(mesh, batch)), ...] (host or device).
      mesh: the mesh.
      batch: the global number of rows.
    Returns:
      the same pytree of global jax.Arrays [batch, ...].
    """
    n = len(process_rows(mesh, batch))
    full = jax.tree.map(lambda x: jax.ShapeDtypeStruct((batch, *np.shape(x)[1:]), x.dtype), tree)
    bad = [np.shape(x) for x in jax.tree.leaves(tree) if not np.shape(x) or np.shape(x)[0] != n]
    if bad:
        raise JspecError(f"place_rows: this process holds {n} of {batch} rows; got arrays of "
                         f"shapes {bad}")
    return jax.tree.map(lambda x, s, f: jax.make_array_from_process_local_data(
        s, np.asarray(x), f.shape), tree, state_sharding(full, mesh, batch=batch), full)


def to_host(tree: Any) -> Any:
    """NumPy copies of every array of `tree`, also of global arrays spanning other processes.

    On one process this is `jax.device_get`. An array with shards on other processes is
    gathered with `multihost_utils.process_allgather` — a collective: every process must call
    `to_host` on the same arrays, in the same order.
    """
    def one(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return jax.device_get(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def head_dim_of(obj: Any) -> int | None:
    """The head size of a drafter's config (`cfg` or `config`; a proposer's inner drafter's),
    if it has one."""
    cfg = getattr(obj, "cfg", None) or getattr(obj, "config", None)
    if cfg is None and getattr(obj, "inner", None) is not None:
        return head_dim_of(obj.inner)
    return getattr(cfg, "head_dim", None)


def params_sharding(tree: Any, mesh: Mesh, *, head_dim: int | None = None) -> Any:
    """NamedShardings for a parameter pytree (`param_specs` on `mesh`)."""
    return named(mesh, param_specs(tree, mesh, head_dim=head_dim))


def state_sharding(tree: Any, mesh: Mesh, *, batch: int) -> Any:
    """NamedShardings for a per-row state pytree (`state_specs` on `mesh`)."""
    return named(mesh, state_specs(tree, mesh, batch=batch))


def shard_model(model: Any, mesh: Mesh) -> Any:
    """The model with its weights placed on `mesh` by the rules (do it once, then generate)."""
    mesh = resolve_mesh(mesh)
    w = place(model.weights, params_sharding(model.weights, mesh, head_dim=model.config.head_dim))
    return dataclasses.replace(model, weights=w)


def shard_drafter(drafter: Any, mesh: Mesh) -> Any:
    """A drafter with its arrays (weights / params, shared embedding, head) placed on `mesh`.

    Drafters without arrays (n-gram) are returned as they are.
    """
    if drafter is None or not jax.tree.leaves(drafter):
        return drafter
    mesh = resolve_mesh(mesh)
    return place(drafter, params_sharding(drafter, mesh, head_dim=head_dim_of(drafter)))


# ----------------------------------------------------------------------------- shard_map
def shard_map(fn: Callable[..., Any], mesh: Mesh, in_axes: Any, out_axes: Any,
              rules: tuple[tuple[str, str | None], ...] = RULES, check_vma: bool = True
              ) -> Callable[..., Any]:
    """`jax.shard_map` of `fn` with specs from logical axes (how Pallas calls are wrapped).

    A kernel sees its per-device block: e.g. attention with q `("batch", None, "heads", None)`
    and caches `("batch", "kv_heads", "seq", "head_dim")` run on its rows and heads only, with no
    collective. Unlike placement, a logical axis here always maps to its mesh axis (shard_map
    needs divisible shapes; the caller checks, e.g. with `logical_spec`).

    Args:
      fn: the per-device function.
      mesh: the mesh.
      in_axes / out_axes: pytrees of `Axes` tuples matching fn's arguments / outputs.
    Returns:
      the wrapped function.
    """
    table = dict(rules)
    names = set(mesh.axis_names)

    def to_spec(axes):
        return PartitionSpec(*[table.get(n) if n is not None and table.get(n) in names else None
                               for n in axes])

    is_axes = lambda x: isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)  # noqa: E731
    in_specs = jax.tree.map(to_spec, in_axes, is_leaf=is_axes)
    out_specs = jax.tree.map(to_spec, out_axes, is_leaf=is_axes)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=check_vma)


def shard_kernel(fn: Callable[..., Any], in_axes: Any, out_axes: Any, *,
                 mesh: Mesh | AbstractMesh | None = None,
                 rules: tuple[tuple[str, str | None], ...] = RULES,
                 check_vma: bool = False) -> Callable[..., Any]:
    """`fn` run per device under the mesh in context (how a Pallas call goes into model code).

    With no mesh (`mesh` None and no `jax.set_mesh` context, e.g. on one device) this is `fn`
    itself. Under a mesh it is `shard_map(fn, mesh, in_axes, out_axes)` with one safety rule:
    a mesh axis is used only if it divides *every* dimension mapped to it in the inputs and
    outputs; otherwise that mesh axis is dropped for the whole call (the arrays are replicated
    along it), so that e.g. query heads are never split while their KV heads are not.
    `jspec.generate` traces under `jax.set_mesh(<its mesh>)`, so the context is there.

    Args:
      fn: the per-device function (e.g. a jitted Pallas wrapper).
      in_axes / out_axes: pytrees of `Axes` tuples for fn's positional args / outputs.
      mesh: default: the context mesh.
      check_vma: off by default: a `pallas_call`'s output shapes carry no varying-axes
        annotation, which shard_map's check requires.
    Returns:
      a function with fn's signature.
    """
    is_axes = lambda x: isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)  # noqa: E731

    def call(*args: Any) -> Any:
        m = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
        if (m is None or m.empty) and mesh is None:
            m = _KERNEL_MESH.get()
        if m is None or m.empty or m.size == 1:
            return fn(*args)
        out_shapes = jax.eval_shape(fn, *args)
        table, sizes = dict(rules), dict(m.shape)
        dropped: set[str] = set()
        for axes_tree, values in ((in_axes, args), (out_axes, out_shapes)):
            axes_list = jax.tree.leaves(axes_tree, is_leaf=is_axes)
            arrays = jax.tree.leaves(values)
            if len(axes_list) != len(arrays):
                raise JspecError(f"{len(axes_list)} logical-axes entries for {len(arrays)} arrays")
            for axes, a in zip(axes_list, arrays, strict=True):
                for name, dim in zip(axes, a.shape, strict=True):
                    target = table.get(name) if name is not None else None
                    if target in sizes and dim % sizes[target]:
                        dropped.add(target)
        use = tuple((k, None if v in dropped else v) for k, v in rules)
        return shard_map(fn, m, in_axes, out_axes, rules=use, check_vma=check_vma)(*args)

    return call
