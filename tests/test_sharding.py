"""Sharding: the rules table (in process), a Llama-3-8B + DFlash layout (abstract), and the
8-device cases of `tests/mesh_cases.py`, each run in a subprocess with 8 fake CPU devices."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType, Mesh, PartitionSpec

import jspec
from jspec import sharding
from jspec.drafters import dflash
from jspec.drafters.trained import DrafterConfig
from jspec.models import ModelConfig, init_weights
from jspec.rounds import init_state
from jspec.verify import Lossless

ROOT = Path(__file__).resolve().parent.parent
P = PartitionSpec
GiB = 2**30


def _amesh(data: int, model: int) -> AbstractMesh:
    return AbstractMesh((data, model), ("data", "model"))


# ----------------------------------------------------------------------------- the rules table
def test_logical_axes_map_through_the_rules_table():
    m = _amesh(2, 4)
    assert sharding.logical_spec(("batch", "seq", "kv_heads", "head_dim"), (8, 64, 8, 16), m) \
        == P("data", None, "model")
    assert sharding.logical_spec(("vocab", "embed"), (128, 32), m) == P("model")
    assert sharding.logical_spec(("embed", "mlp"), (32, 64), m) == P(None, "model")
    # Not divisible: replicated (vocab 97; a batch of 3 rows on data=2).
    assert sharding.logical_spec(("vocab", "embed"), (97, 32), m) == P()
    assert sharding.logical_spec(("batch", None), (3, 5), m) == P()
    # Flattened heads: 4 heads x 8 = 32 columns divide by 8, but heads would be split: replicated.
    m8 = _amesh(1, 8)
    assert sharding.logical_spec(("embed", "heads"), (32, 32), m8, units={"heads": 8}) == P()
    assert sharding.logical_spec(("embed", "heads"), (32, 32), m, units={"heads": 8}) \
        == P(None, "model")
    # A mesh axis is used once per array; a size-1 axis is not used at all.
    assert sharding.logical_spec(("vocab", "mlp"), (128, 64), m) == P("model")
    assert sharding.logical_spec(("batch", "heads"), (8, 64), _amesh(1, 8)) == P(None, "model")
    # Another table: the same call sites, another layout.
    rules = tuple((k, None if k == "vocab" else v) for k, v in sharding.RULES)
    assert sharding.logical_spec(("vocab", "embed"), (128, 32), m, rules) == P()
    # A mesh without a `data` axis (pure tensor parallelism): batch replicated.
    tp = AbstractMesh((8,), ("model",))
    assert sharding.logical_spec(("batch", "kv_heads"), (8, 8), tp) == P(None, "model")
    with pytest.raises(jspec.JspecError):
        sharding.logical_spec(("batch",), (8, 2), m)


def test_param_and_state_specs_from_declared_axes():
    cfg = ModelConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=8, num_kv_heads=4,
                      head_dim=8, ffn_size=64, tie_embeddings=False, qkv_bias=True)
    w = jax.eval_shape(lambda: init_weights(cfg, jax.random.key(0)))
    specs = sharding.param_specs(w, _amesh(2, 4), head_dim=8)
    lw = specs.layers[0]
    assert (specs.embed, specs.lm_head) == (P("model"), P(None, "model"))
    assert (lw.wq, lw.wk, lw.wv, lw.wo) == (P(None, "model"),) * 3 + (P("model"),)
    assert (lw.w_gate, lw.w_up, lw.w_down) == (P(None, "model"), P(None, "model"), P("model"))
    assert (lw.bq, lw.bk, lw.attn_norm, specs.final_norm) == (P("model"), P("model"), P(), P())
    # 4 KV heads on model=8: KV projections replicated, query heads (8) still sharded.
    s8 = sharding.param_specs(w, _amesh(1, 8), head_dim=8).layers[0]
    assert (s8.wq, s8.wk, s8.bk) == (P(None, "model"), P(), P())
    # Optimizer moments follow their parameter (the field that holds them declares the axes).
    moments = jax.eval_shape(lambda: optax.adam(1e-3).init(w))
    ms = sharding.param_specs(moments, _amesh(2, 4), head_dim=8)[0]
    assert (ms.mu.layers[0].wq, ms.nu.layers[1].w_down, ms.count) == (
        P(None, "model"), P("model"), P())
    # Nothing is inferred from a name: an undeclared array called `wq` is replicated.
    assert sharding.param_specs({"wq": jax.ShapeDtypeStruct((32, 64), jnp.float32)},
                                _amesh(2, 4), head_dim=8) == {"wq": P()}
    cache = jax.eval_shape(lambda: jspec.KVCache.create(cfg, 8, 64))
    cs = sharding.state_specs({"cache": cache, "seq": jnp.zeros((8, 5)), "key": jnp.zeros(()),
                               "other": jnp.zeros((3, 8))}, _amesh(2, 4), batch=8)
    assert cs["cache"].k[0] == P("data", "model") and cs["cache"].lengths == P("data")
    assert (cs["seq"], cs["key"], cs["other"]) == (P("data"), P(), P())


def test_meshes_are_auto_typed_and_validated():
    dev = np.asarray(jax.devices()[:1]).reshape(1, 1)
    explicit = Mesh(dev, ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    auto = sharding.resolve_mesh(explicit)
    assert auto.axis_types == (AxisType.Auto,) * 2 and auto.axis_names == ("data", "model")
    assert sharding.resolve_mesh(None) is None
    with jax.set_mesh(explicit):
        assert sharding.resolve_mesh(None).axis_types == (AxisType.Auto,) * 2
    with pytest.raises(jspec.JspecError, match="data"):
        sharding.resolve_mesh(Mesh(dev, ("x", "y")))
    for bad in ("2", "2x", "axb", "2x4x1"):
        with pytest.raises(jspec.JspecError, match="DATAxMODEL"):
            sharding.parse_mesh(bad)
    with pytest.raises(jspec.JspecError, match="devices"):
        sharding.make_mesh(3, 5)


def test_per_device_bytes_divides_by_the_mesh_axes():
    tree = {"a": jax.ShapeDtypeStruct((8, 16), jnp.float32),
            "b": jax.ShapeDtypeStruct((10,), jnp.bfloat16)}
    m = _amesh(2, 4)
    assert sharding.per_device_bytes(tree, {"a": P("data", "model"), "b": P()}, m) == 4 * 4 * 4 + 20
    assert sharding.per_device_bytes(tree, {"a": P(("data", "model")), "b": P()}, m) == 16 * 4 + 20


# ----------------------------------------------------------------------------- full size
LLAMA3_8B = ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096, num_layers=32,
                        num_heads=32, num_kv_heads=8, head_dim=128, ffn_size=14336,
                        rope_theta=500000.0, tie_embeddings=False, max_position=8192,
                        dtype="bfloat16")
# Sized like the DFlash paper's drafter for Llama-3.1-8B: 5 layers at the target's width,
# 5 target feature layers, block 16; the full vocabulary as the draft vocabulary (worst case).
DFLASH_8B = DrafterConfig(kind="dflash", hidden_size=4096, num_heads=32, num_kv_heads=8,
                          head_dim=128, ffn_size=14336, num_layers=5,
                          feature_layers=(1, 8, 16, 24, 31), draft_vocab=128256,
                          target_vocab=128256, rope_theta=500000.0, rms_eps=1e-5, block=16)


def test_llama3_8b_with_dflash_and_4k_cache_fits_16gib_per_device_on_1x8():
    """Abstract (jax.eval_shape, no allocation): Llama-3-8B in bfloat16, a 5-layer DFlash drafter
    (float32 params), batch 8, a 4096-slot cache, k = 15. Per-device bytes from the rules-table
    shardings on a 1x8 mesh <= 16 GiB; on one device the same state does not fit in 16 GiB."""
    mesh = _amesh(1, 8)
    b, prompt, capacity, k = 8, 1024, 4096, 15
    key = jax.random.key(0)
    weights = jax.eval_shape(lambda: init_weights(LLAMA3_8B, key))
    vocab = np.arange(DFLASH_8B.draft_vocab)

    def make_drafter():
        return dflash.make(DFLASH_8B, dflash.init_params(DFLASH_8B, key), vocab,
                           init_weights(LLAMA3_8B, key))

    drafter = jax.eval_shape(make_drafter)
    state = jax.eval_shape(
        lambda w, d: init_state(LLAMA3_8B, w, d, jnp.zeros((b, prompt), jnp.int32),
                                jnp.full((b,), prompt, jnp.int32), key,
                                sampling=jspec.Sampling(), max_new_tokens=capacity - prompt - k - 1,
                                capacity=capacity, eos_ids=(), k=k, verifier=Lossless()),
        weights, drafter)
    # The drafter's `embed` is the target's embedding (the same buffer): count it once.
    own = dataclasses.replace(drafter, embed=None)
    parts = {
        "target weights": (weights, sharding.param_specs(weights, mesh, head_dim=128)),
        "drafter": (own, sharding.param_specs(own, mesh, head_dim=128)),
        "decode state": (state, sharding.state_specs(state, mesh, batch=b)),
    }
    per_dev = {n: sharding.per_device_bytes(t, s, mesh) for n, (t, s) in parts.items()}
    whole = {n: sharding.per_device_bytes(t, jax.tree.map(lambda _: P(), t), mesh)
             for n, (t, _) in parts.items()}
    report = ", ".join(f"{n} {per_dev[n] / GiB:.2f} of {whole[n] / GiB:.2f} GiB" for n in per_dev)
    print(f"per device on 1x8: {report}")
    assert 14.9 * GiB < whole["target weights"] < 15 * GiB  # 8.03e9 bfloat16 parameters
    assert whole["decode state"] > 5 * GiB  # target cache 4 GiB (bf16) + DFlash context K/V (f32)
    assert sum(whole.values()) > 16 * GiB  # one device could not hold it
    assert sum(per_dev.values()) <= 16 * GiB
    # Everything large is split 8 ways; norms, small vectors and the drafter's feature
    # projection `fc` ([5 x 4096, 4096], 0.31 GiB: its output is the replicated residual) are not.
    assert per_dev["target weights"] < whole["target weights"] / 8 * 1.01
    assert per_dev["decode state"] < whole["decode state"] / 8 * 1.05  # rows are not split on 1x8
    assert per_dev["drafter"] < whole["drafter"] / 8 + 0.32 * GiB
    kv = state.cache.k[0]
    assert sharding.state_specs(state, mesh, batch=b).cache.k[0] == P(None, "model")
    assert kv.shape == (b, 8, capacity, 128)


# ----------------------------------------------------------------------------- 8 fake devices
def eight_device_env() -> dict[str, str]:
    """The environment of a child process with 8 fake CPU devices (other XLA flags kept)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return dict(os.environ, JAX_PLATFORMS="cpu",
                XLA_FLAGS=" ".join([*flags, "--xla_force_host_platform_device_count=8"]))


def _run_mesh_cases(marker: str) -> None:
    """Runs the cases of tests/mesh_cases.py selected by `-m marker` in a fresh process with 8
    devices (whatever this process has); its pytest report is the failure message."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-o",
                        "addopts=-p no:cacheprovider", "-m", marker, "tests/mesh_cases.py"],
                       cwd=ROOT, env=eight_device_env(), capture_output=True, text=True,
                       timeout=3600)
    if r.returncode != 0 or " passed" not in r.stdout:
        pytest.fail(f"tests/mesh_cases.py (-m {marker!r}) failed in its 8-device subprocess "
                    f"(exit {r.returncode}):\n{r.stdout[-10000:]}\n{r.stderr[-3000:]}",
                    pytrace=False)


def test_mesh_cases_on_8_fake_cpu_devices():
    """Greedy identity on 1x8 / 2x4 / 8x1, χ² at T=1 on 2x4, one train step on 2x4, layouts,
    no cache-sized collective, set_mesh / explicit meshes / user jit, shard_map (see
    tests/mesh_cases.py)."""
    _run_mesh_cases("not slow")


@pytest.mark.slow
def test_mesh_cases_on_8_fake_cpu_devices_slow():
    """The same checks for every drafter with weights, both trained kinds and every mesh."""
    _run_mesh_cases("slow")
