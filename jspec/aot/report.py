"""Compile jspec's programs for a TPU slice with abstract weights and report what the compiler
says per chip: compile time, HBM (arguments, temporaries, outputs) against the chip, bytes
accessed and flops, and times *modelled* from them with one roofline (`jspec.aot.chips`).

Nothing here runs on a TPU: every time in a report is modelled, and labelled so.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import resource
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec import platforms, sharding
from jspec.aot.chips import Chip, chip_of, tpu_mesh
from jspec.aot.hlo import hbm_traffic
from jspec.errors import JspecError
from jspec.models.cache import KVCache
from jspec.models.config import ModelConfig
from jspec.models.llama import Chain, Tree, forward, init_weights
from jspec.models.loading import config_from_hf

HF_CONFIGS = Path(__file__).resolve().parent.parent / "assets" / "hf_configs"


def model_config(model: str, dtype: str = "bfloat16") -> ModelConfig:
    """A ModelConfig from a shipped architecture name (`jspec/assets/hf_configs/NAME.json`:
    llama-3.1-8b, llama-3.1-70b, qwen3-8b), an HF `config.json` path, or a directory holding
    one. Shapes only: no weights are read."""
    p = Path(model)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        p = HF_CONFIGS / f"{model}.json"
    if not p.is_file():
        known = sorted(f.stem for f in HF_CONFIGS.glob("*.json"))
        raise JspecError(f"no model {model!r}: give a config.json, a directory with one, or one "
                         f"of {known}")
    cfg = config_from_hf(json.loads(p.read_text()))
    return dataclasses.replace(cfg, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What the TPU compiler said about one program, per chip."""

    name: str
    ok: bool
    error: str = ""
    compile_s: float = 0.0  # measured: wall time of lower + compile on this host
    argument_bytes: int = 0
    temp_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    bytes_accessed: float = 0.0  # the cost analysis's (counts VMEM prefetches again)
    hbm_bytes_read: float = 0.0  # modelled from the compiled HLO (`jspec.aot.hlo`)
    hbm_bytes_written: float = 0.0
    flops: float = 0.0  # matmul flops from the compiled HLO (`jspec.aot.hlo`), scan trips too
    mosaic_calls: int = 0  # Mosaic (Pallas TPU) kernels in the compiled HLO
    compile_cpu_s: float = 0.0  # measured: this process's CPU seconds of lower + compile
    # The cost analysis's flops: a while body (scanned layers) counted once, not per trip.
    flops_cost_analysis: float = 0.0

    @property
    def hbm_bytes(self) -> int:
        """Peak HBM of the program: its arguments, temporaries and outputs not aliased."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    def modelled_s(self, chip: Chip) -> float:
        """Roofline time: the larger of HBM bytes (read + written, from the HLO) / HBM bandwidth
        and flops / peak (modelled). Mosaic kernels report no flops: see the report's note."""
        return max((self.hbm_bytes_read + self.hbm_bytes_written) / chip.hbm_bytes_per_s,
                   self.flops / chip.bf16_flops_per_s)


def compile_program(name: str, fn: Any, args: tuple[Any, ...], donate: tuple[int, ...] = ()
                    ) -> Compiled:
    """Lower and compile `fn(*args)` (abstract args with shardings) and read its analyses."""
    t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_utime
    try:
        c = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    except Exception as e:  # the report says what failed instead of stopping
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:400]
        return Compiled(name, False, msg, time.perf_counter() - t0)
    dt = time.perf_counter() - t0
    cpu = resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu0
    mem = c.memory_analysis()
    cost = c.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per module
        cost = cost[0] if cost else {}
    hlo = c.as_text()
    traffic = hbm_traffic(hlo)
    return Compiled(name, True, "", dt, int(mem.argument_size_in_bytes),
                    int(mem.temp_size_in_bytes), int(mem.output_size_in_bytes),
                    int(mem.alias_size_in_bytes), float(cost.get("bytes accessed", 0.0)),
                    traffic["hbm_read_bytes"], traffic["hbm_written_bytes"],
                    traffic["flops"], hlo.count('custom_call_target="tpu_custom_call"'), cpu,
                    float(cost.get("flops", 0.0)))


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        tree, shardings)


def _per_chip_bytes(tree: Any) -> int:
    """Bytes of one chip's shards of the abstract arrays of `tree`."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
               for a in jax.tree.leaves(tree))


@dataclasses.dataclass
class Setup:
    """Abstract weights and cache of a model on a slice."""

    config: ModelConfig
    mesh: jax.sharding.Mesh
    batch: int
    context: int  # cache capacity (slots)
    weights: Any
    cache: Any

    @property
    def weight_bytes(self) -> int:
        return _per_chip_bytes(self.weights)

    @property
    def step_weight_bytes(self) -> int:
        """Weight bytes a step must read: all of them but an untied embedding table, of which
        it gathers only its rows (a tied table is read whole as the LM head)."""
        if self.config.tie_embeddings:
            return self.weight_bytes
        return self.weight_bytes - _per_chip_bytes(self.weights.embed)

    def live_kv_bytes(self, filled: int) -> int:
        """Bytes of one chip's KV shards that a step attends to with `filled` slots in use."""
        return int(_per_chip_bytes((self.cache.k, self.cache.v)) * filled / self.context)


def kv_heads_for(config: ModelConfig, model_axis: int) -> ModelConfig:
    """The config with its KV heads repeated (`jspec.models.llama.repeat_kv_heads`, exact) so
    that they shard over a `model` axis wider than them (8 KV heads on 16 chips: 2x); the
    config unchanged where they already divide it or cannot be repeated to."""
    kv, g = config.num_kv_heads, config.num_heads // config.num_kv_heads
    if model_axis <= kv or model_axis % kv or g % (model_axis // kv):
        return config
    return dataclasses.replace(config, num_kv_heads=model_axis)


def setup(config: ModelConfig, topology: str, batch: int, context: int,
          model_parallel: int | None = None, scan_layers: bool = True) -> Setup:
    """Abstract weights (`jax.eval_shape(init_weights)`) and an abstract KV cache of `context`
    slots, laid out on the slice by `jspec.sharding.RULES` (heads / MLP / vocabulary over the
    `model` axis, rows over `data`); KV heads repeated where the `model` axis is wider than
    them (`kv_heads_for`). `scan_layers`: the layers stacked and scanned (jspec's layout for
    TPU, `ModelConfig.scan_layers`) or unrolled over per-layer buffers."""
    mesh = tpu_mesh(topology, model_parallel)
    config = kv_heads_for(config, dict(mesh.shape)["model"]).replace(scan_layers=scan_layers)
    w = jax.eval_shape(functools.partial(init_weights, config), jax.random.key(0))
    w = _abstract(w, sharding.params_sharding(w, mesh, head_dim=config.head_dim))
    with platforms.compiling_for("tpu"):  # the cache's storage dtype is the TPU's
        cache = jax.eval_shape(lambda: KVCache.create(config, batch, context))
    cache = _abstract(cache, sharding.state_sharding(cache, mesh, batch=batch))
    return Setup(config, mesh, batch, context, w, cache)


def step_program(s: Setup, t: int, tree: bool = False) -> Compiled:
    """One target forward of `t` new tokens per row over the cache, the cache written and its
    buffers donated (an autoregressive step at t = 1, a verify forward of K = t - 1 drafts at
    t > 1; `tree`: the t nodes as a binary tree, not a chain)."""
    rows = jax.sharding.NamedSharding(s.mesh, sharding.logical_spec(("batch", None),
                                                                    (s.batch, t), s.mesh))
    toks = jax.ShapeDtypeStruct((s.batch, t), jnp.int32, sharding=rows)
    pos = jax.ShapeDtypeStruct((s.batch, t), jnp.int32, sharding=rows)
    parents = np.arange(t, dtype=np.int32) - 1 if not tree else (np.arange(t) - 1) // 2
    parents[0] = -1
    mask = Tree(jnp.asarray(parents)) if tree else Chain()
    cfg = s.config

    def step(w, tokens, positions, cache):
        out = forward(cfg, w, tokens, positions, cache, mask=mask)
        return out.logits, out.cache

    name = f"{'tree' if tree else 'chain'} forward T={t}"
    with sharding.using(s.mesh):  # the context mesh: Pallas calls run per device (shard_map)
        return compile_program(name, step, (s.weights, toks, pos, s.cache), donate=(3,))


def largest_batch(s: Setup, chip: Chip, step: Compiled) -> int:
    """The largest batch whose decode step fits one chip's HBM at this context (modelled from
    the compiled step: weights fixed, the rest scaled with the batch)."""
    if not step.ok:
        return 0
    per_row = max(step.hbm_bytes - s.weight_bytes, 1) / s.batch
    return max(int((chip.hbm_bytes - s.weight_bytes) // per_row), 0)


def report(model: str, topology: str, batch: int = 1, context: int = 4096,
           nodes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), trees: bool = True,
           tau: float = 2.5, model_parallel: int | None = None, dtype: str = "bfloat16",
           progress: Any = None, scan_layers: bool = True) -> dict[str, Any]:
    """Compile the decode step and the verify forwards of a model on a TPU slice; return the
    JSON-ready report (every time in it modelled, from `jspec.aot.chips.CHIPS`). The byte floor
    of a step: its weights (an untied embedding table only as gathered rows) and the live KV
    cache, each read once."""
    chip = chip_of(topology)
    cfg = model_config(model, dtype)
    s = setup(cfg, topology, batch, context, model_parallel, scan_layers)
    filled = context - max(nodes) - 1
    floor = s.step_weight_bytes + s.live_kv_bytes(filled)
    rows: list[dict[str, Any]] = []
    progs = [(t, False) for t in nodes] + ([(t, True) for t in nodes if t > 2] if trees else [])
    base = None
    for t, tree in progs:
        c = step_program(s, t, tree)
        if progress:
            progress(c)
        if t == 1 and not tree:
            base = c
        row = dataclasses.asdict(c) | {"t": t, "tree": tree, "hbm_bytes": c.hbm_bytes,
                                       "fits": c.ok and c.hbm_bytes <= chip.hbm_bytes,
                                       "modelled_s": c.modelled_s(chip) if c.ok else None}
        rows.append(row)
    ar = base.modelled_s(chip) if base and base.ok else None
    for r in rows:
        r["c_modelled"] = r["modelled_s"] / ar if ar and r["modelled_s"] else None
        r["speedup_modelled"] = (min(tau, r["t"]) / r["c_modelled"]
                                 if r["c_modelled"] and r["t"] > 1 else None)
    return {
        "model": model, "topology": topology, "chips": int(s.mesh.size),
        "mesh": dict(s.mesh.shape), "chip": dataclasses.asdict(chip), "batch": batch,
        "context": context, "dtype": dtype, "tau": tau,
        "layers": "scanned" if scan_layers else "unrolled",
        "weights_bytes_per_chip": s.weight_bytes, "live_kv_bytes_per_chip": s.live_kv_bytes(filled),
        "byte_floor_per_chip": floor,
        "ar_bytes_over_floor": (base.hbm_bytes_read / floor) if base and base.ok else None,
        "largest_batch_at_context": largest_batch(s, chip, base) if base else 0,
        "programs": rows,
        "note": ("modelled: roofline max(bytes/HBM bandwidth, flops/peak) per chip from the TPU "
                 "compiled HLO: HBM bytes of each top-level instruction's operands and outputs "
                 "in memory space 0 (jspec/aot/hlo.py; the cost analysis's 'bytes accessed' also "
                 "counts VMEM prefetch copies, kept as bytes_accessed), flops the matmuls' (dot / "
                 "convolution) from the same walk, a scanned layer once per trip (elementwise work "
                 "and Mosaic kernels not counted; the cost analysis's, which counts a while body "
                 "once, kept as flops_cost_analysis). "
                 "speedup_modelled = min(tau, T) / c(T): verify forward only (drafting and "
                 "acceptance not included)."),
    }


def table(rep: dict[str, Any]) -> str:
    """A plain-text table of a report."""
    gb = 1e9
    lines = [f"{rep['model']} on {rep['topology']} ({rep['chips']} chips, mesh {rep['mesh']}), "
             f"batch {rep['batch']}, context {rep['context']}, {rep['dtype']}; per chip; "
             "times MODELLED (roofline)",
             f"weights {rep['weights_bytes_per_chip'] / gb:.2f} GB, live KV "
             f"{rep['live_kv_bytes_per_chip'] / gb:.2f} GB, byte floor "
             f"{rep['byte_floor_per_chip'] / gb:.2f} GB; AR step reads (HBM, modelled) "
             f"{rep['ar_bytes_over_floor'] or float('nan'):.2f}x the floor; largest batch at this "
             f"context {rep['largest_batch_at_context']}",
             f"{'program':<22}{'ok':>4}{'fits':>5}{'compile s':>11}{'HBM GB':>9}{'GB read':>9}"
             f"{'(cost)':>8}"
             f"{'GFLOP':>9}{'mosaic':>8}{'t ms (m)':>10}{'c(T) (m)':>10}{'x@tau (m)':>10}"]
    for r in rep["programs"]:
        f = lambda v, fmt: format(v, fmt) if v is not None else "-"  # noqa: E731
        lines.append(f"{r['name']:<22}{'yes' if r['ok'] else 'NO':>4}"
                     f"{'yes' if r['fits'] else 'NO':>5}{r['compile_s']:>11.1f}"
                     f"{r['hbm_bytes'] / gb:>9.2f}{r['hbm_bytes_read'] / gb:>9.3f}"
                     f"{r['bytes_accessed'] / gb:>8.2f}"
                     f"{r['flops'] / 1e9:>9.1f}{r['mosaic_calls']:>8}"
                     f"{f(r['modelled_s'] and r['modelled_s'] * 1e3, '.3f'):>10}"
                     f"{f(r['c_modelled'], '.3f'):>10}{f(r['speedup_modelled'], '.2f'):>10}")
        if not r["ok"]:
            lines.append(f"    error: {r['error']}")
    for r in rep.get("generate", []) + rep.get("rounds", []):
        extra = ""
        if r.get("besides_forward_over_ar_step") is not None:
            extra = (f", round {r['modelled_s'] * 1e3:.3f} ms (m) = verify forward "
                     f"{r['verify_forward_modelled_s'] * 1e3:.3f} ms + "
                     f"{r['besides_forward_over_ar_step']:.1%} of an AR step (m)")
        lines.append(f"{r['name']:<34}{'ok' if r['ok'] else 'FAILED':>7} compile "
                     f"{r['compile_s']:6.1f} s, HBM {r['hbm_bytes'] / gb:6.2f} GB{extra}"
                     f"{'' if r['ok'] else '  ' + r['error']}")
    return "\n".join(lines)
