"""Compiling jspec for real TPU topologies from this CPU machine (libtpu, no TPU needed).

The `tpu` extra installs libtpu; `.ci/run` installs it, so in CI a missing libtpu fails here
instead of skipping. Small-but-real shapes (head_dim 64 and 128, GQA) keep these fast; the 8B /
70B compiles are `-m slow` (tests/test_tpu_scale.py).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import platforms
from jspec.models import ModelConfig, init_weights
from jspec.models.model import Model

if importlib.util.find_spec("libtpu") is None:
    if os.environ.get("CI"):
        raise RuntimeError("libtpu is missing: .ci/run installs the 'tpu' extra")
    pytest.skip("libtpu not installed (pip install -e '.[tpu]')", allow_module_level=True)

from jax.experimental import topologies

CFG = ModelConfig(arch="llama", vocab_size=512, hidden_size=256, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=64, ffn_size=512, eos_ids=(1,), dtype="bfloat16")


@functools.cache
def tpu_mesh(name: str = "v5e:1x1") -> jax.sharding.Mesh:
    kw = {"chips_per_host_bounds": (1, 1, 1)} if name.endswith(":1x1") else {}
    devs = topologies.get_topology_desc(topology_name=name, platform="tpu", **kw).devices
    return jax.sharding.Mesh(np.array(devs), ("data",))


def abstract(tree, sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def custom_calls(hlo: str) -> set[str]:
    return {x.split('"')[0] for x in hlo.split('custom_call_target="')[1:]}


def generate_fn(cfg, drafter, **kw):
    def f(w, ids, lens, key):
        return jspec.generate(Model(config=cfg, weights=w), ids, lens, drafter=drafter, key=key,
                              **kw).tokens
    return f


def lower_for(mesh, cfg, drafter, batch=2, width=64, **kw):
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    w = abstract(jax.eval_shape(functools.partial(init_weights, cfg), jax.random.key(0)), rep)
    ids = jax.ShapeDtypeStruct((batch, width), jnp.int32, sharding=rep)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rep)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep)
    return jax.jit(generate_fn(cfg, drafter, **kw)).lower(w, ids, lens, key)


def test_generate_compiles_for_tpu_with_every_default():
    """A user's jit around `generate` (n-gram drafter, T = 1, every option at its default, no
    environment variable) compiles for a v5e chip from this CPU host: the CPU GEMM kernel stays
    out, the Mosaic tree-attention kernel is in; the same program lowered for this CPU keeps
    XLA attention (the choice follows the compiled devices, not the host)."""
    assert "JSPEC_CPU_GEMM" not in os.environ
    target = Model(config=CFG, weights=jax.eval_shape(functools.partial(init_weights, CFG),
                                                      jax.random.key(0)))
    drafter = jspec.load_drafter("ngram", target=target)
    kw = dict(max_new_tokens=32, sampling=jspec.Sampling(temperature=1.0))
    compiled = lower_for(tpu_mesh(), CFG, drafter, **kw).compile()
    calls = custom_calls(compiled.as_text())
    assert "tpu_custom_call" in calls  # Mosaic: the tree-attention kernel
    assert "jspec_small_gemm" not in calls
    mem = compiled.memory_analysis()
    assert mem.argument_size_in_bytes > 0 and mem.temp_size_in_bytes > 0

    cpu_mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("data",))
    cpu_hlo = lower_for(cpu_mesh, CFG, drafter, **kw).as_text()
    assert "tpu_custom_call" not in cpu_hlo


def test_platform_follows_devices_not_host():
    """`jspec.platforms`: the platform of the mesh / arrays, the abstract mesh inside a trace,
    and `choose` resolved at lowering when unknown at trace time."""
    mesh = tpu_mesh()
    assert platforms.of_mesh(mesh) == "tpu"
    assert platforms.of_mesh(mesh.abstract_mesh) == "tpu"
    assert platforms.of_arrays(jnp.ones(2)) == "cpu"
    assert platforms.target() is None
    with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else jax.set_mesh(mesh):
        assert platforms.target() == "tpu"
    with platforms.compiling_for("gpu"):
        assert platforms.target() == "gpu"

    def f(x):
        return platforms.choose(x, cpu=lambda x: x + 1.0, tpu=lambda x: x + 2.0,
                                default=lambda x: x + 3.0)

    assert float(jax.jit(f)(jnp.float32(0))) == 1.0  # lowered for this CPU
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    tpu_text = jax.jit(f).lower(jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)).as_text()
    assert "2.0" in tpu_text and "1.0" not in tpu_text


@pytest.mark.parametrize("t,hd,kv", [(1, 64, 2), (16, 128, 8), (64, 128, 4)])
def test_tree_attention_kernel_compiles_with_mosaic(t, hd, kv):
    """The tree-attention kernel through Mosaic for v5e at head_dim 64 / 128, GQA 4 and 8,
    decode (T = 1) to 64-node trees."""
    from pallas_kernels.tree_attention import tree_attention

    rep = jax.sharding.NamedSharding(tpu_mesh(), jax.sharding.PartitionSpec())
    b, s, h = 2, 1024, kv * 4
    sd = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=rep)  # noqa: E731
    f = functools.partial(tree_attention, platform="tpu")
    c = jax.jit(f).lower(sd(b, t, h, hd), sd(b, kv, s, hd), sd(b, kv, s, hd),
                         sd(b, dt=jnp.int32), sd(b, t, kv, hd), sd(b, t, kv, hd),
                         sd(b, t, dt=jnp.int32)).compile()
    assert "tpu_custom_call" in custom_calls(c.as_text())


def test_machine_class_of_a_tpu_device_and_drafter_records_follow_it(tmp_path, monkeypatch):
    """A TPU generation is a machine class; a drafter loaded for weights laid out on a TPU
    topology takes that class's record, not this CPU host's."""
    from jspec import defaults
    from jspec.provenance import machine_class

    monkeypatch.delenv("JSPEC_MACHINE_CLASS", raising=False)
    assert machine_class(tpu_mesh().devices.flat[0]) == "tpu-v5e"
    assert machine_class(tpu_mesh("v6e:1x1").devices.flat[0]) == "tpu-v6e"
    monkeypatch.setenv("JSPEC_DEFAULTS", str(tmp_path / "d.json"))
    defaults.save("ngram", defaults.Record(k=2, dtype="float32", source="t", max_batch=2))
    rep = jax.sharding.NamedSharding(tpu_mesh(), jax.sharding.PartitionSpec())
    w = abstract(jax.eval_shape(functools.partial(init_weights, CFG), jax.random.key(0)), rep)
    on_tpu = jspec.load_drafter("ngram", target=Model(config=CFG, weights=w))
    assert on_tpu.settings.max_batch is None and on_tpu.settings.k == 5  # no tpu-v5e record
    defaults.save("ngram", defaults.Record(k=3, dtype="bfloat16", source="t"),
                  machine="tpu-v5e")
    assert jspec.load_drafter("ngram", target=Model(config=CFG, weights=w)).settings.k == 3


def _one_chip(topology: str) -> jax.sharding.NamedSharding:
    from jspec.aot.chips import tpu_devices

    mesh = jax.sharding.Mesh(np.array(tpu_devices(topology)[:1]), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


ATTENTION = [(8, 1, 8, 4, 32768), (8, 16, 8, 4, 32768), (1, 64, 8, 4, 32768), (8, 64, 4, 8, 8192)]
ACCEPTANCE = [(8, 4, 128256), (8, 8, 151936), (64, 4, 128256)]
GENERATIONS = ["v5e:1x1", "v6e:1x1", "v5p:2x2x1"]


def _kernel_cases(slow: bool):
    for topo in GENERATIONS:
        for i, shape in enumerate(ATTENTION):
            if slow or i == 1:
                yield pytest.param(topo, "attention", shape, marks=[pytest.mark.slow] * slow)
        for i, shape in enumerate(ACCEPTANCE):
            if slow or i == 1:
                yield pytest.param(topo, "acceptance", shape, marks=[pytest.mark.slow] * slow)


@pytest.mark.parametrize("topo,kernel,shape", [*_kernel_cases(False), *_kernel_cases(True)])
def test_kernels_compile_with_mosaic_at_real_shapes(topo, kernel, shape):
    """Both Pallas kernels through Mosaic for v5e, v6e and v5p: tree attention at head_dim 128,
    GQA 4 and 8, caches up to 32k slots, 1-64 nodes; the fused acceptance at Llama-3's 128k and
    Qwen3's 152k vocabularies (default run: one shape each; `-m slow`: all)."""
    from pallas_kernels.relaxed_acceptance.kernel import relaxed_acceptance
    from pallas_kernels.tree_attention import tree_attention

    rep = _one_chip(topo)
    sd = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt, sharding=rep)  # noqa: E731
    if kernel == "attention":
        b, t, kv, g, s = shape
        f = functools.partial(tree_attention, platform="tpu")
        args = (sd(b, t, kv * g, 128), sd(b, kv, s, 128), sd(b, kv, s, 128),
                sd(b, dt=jnp.int32), sd(b, t, kv, 128), sd(b, t, kv, 128), sd(b, t, dt=jnp.int32))
    else:
        b, k, v = shape
        f = functools.partial(relaxed_acceptance, temperature=1.0, platform="tpu")
        args = (sd(b, k + 1, v, dt=jnp.float32), sd(b, k, dt=jnp.int32),
                sd(b, k, v, dt=jnp.float32), sd(b, k, dt=jnp.bool_), None,
                sd(b, k, dt=jnp.float32), sd(b, v, dt=jnp.float32))
    c = jax.jit(f).lower(*args).compile()
    assert "tpu_custom_call" in custom_calls(c.as_text())
