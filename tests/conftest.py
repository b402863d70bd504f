"""Shared fixtures: tiny random models for unit tests, the real SmolLM2-135M for real-model tests."""

from __future__ import annotations

import atexit
import functools
import gc
import importlib.util
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# The tests' programs are compiled at XLA's backend optimization level 0 (this process and the
# subprocesses it starts): the same HLO and the same numerics (XLA:CPU does not use fast math),
# less time in LLVM. Most tests run tiny models whose time is compilation: measured on the
# 2-core CI machine, tests/test_d2sd.py 147 s -> 108 s; the real-model tests come out level
# (tests/test_real_speculative.py 139 s -> 140 s: faster compiles, slower elementwise code).
# Benchmarks and users' programs keep XLA's default level.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# One XLA compilation cache for the test session, this process and the subprocesses it starts
# (they read it from the environment): each module's programs are dropped when it ends
# (`_free_compiled_programs`), and many modules and subprocesses compile the same real-model
# programs again; a hit skips XLA's backend compile (a real-model generate's first call: 12.3 s
# -> 5.8 s here). A fresh directory per session, removed at exit: nothing outlives the run.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = tempfile.mkdtemp(prefix="jspec-test-xla-cache-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "1"
# libtpu (the `tpu` extra, for compile checks) locks the host's TPU chips per process; here it
# only compiles, and pytest-xdist runs two processes.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# A developer's own `jspec calibrate --save` records must not change what the tests run.
os.environ["JSPEC_DEFAULTS"] = os.path.join(os.path.dirname(__file__), "fixtures",
                                            "no-user-defaults.json")
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")))

import jspec  # noqa: E402
from jspec.models import ModelConfig, init_weights  # noqa: E402
from jspec.models.model import Model  # noqa: E402

TINY_VARIANTS = {
    "llama_tied_gqa2": ModelConfig(arch="llama", vocab_size=97, hidden_size=32, num_layers=2,
                                   num_heads=4, num_kv_heads=2, head_dim=8, ffn_size=48,
                                   eos_ids=(1,)),
    "llama_untied_mha": ModelConfig(arch="llama", vocab_size=97, hidden_size=32, num_layers=3,
                                    num_heads=4, num_kv_heads=4, head_dim=8, ffn_size=48,
                                    tie_embeddings=False, eos_ids=(1,)),
    "llama_mqa_scaled": ModelConfig(arch="llama", vocab_size=97, hidden_size=48, num_layers=2,
                                    num_heads=6, num_kv_heads=1, head_dim=8, ffn_size=64,
                                    rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                                                  ("low_freq_factor", 1.0),
                                                  ("original_max_position_embeddings", 64),
                                                  ("rope_type", "llama3")),
                                    eos_ids=(1,)),
    "qwen2_bias": ModelConfig(arch="qwen2", vocab_size=97, hidden_size=32, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=8, ffn_size=48,
                              qkv_bias=True, tie_embeddings=False, rope_theta=1e6, eos_ids=(1,)),
    "qwen3_qknorm": ModelConfig(arch="qwen3", vocab_size=97, hidden_size=32, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=16, ffn_size=48,
                                qk_norm=True, eos_ids=(1,)),
    # Sharding tests: heads, KV heads, MLP and vocabulary divisible by 8 (every mesh axis shards).
    "mesh_gqa": ModelConfig(arch="llama", vocab_size=128, hidden_size=32, num_layers=2,
                            num_heads=16, num_kv_heads=8, head_dim=8, ffn_size=64, eos_ids=(1,)),
}


@functools.cache
def tiny_model(name: str = "llama_tied_gqa2", seed: int = 0) -> Model:
    """A tiny random model, filled by numpy (jax.random compiles per shape: seconds per model
    on a small CPU). Same pytree structure as `init_weights`."""
    cfg = TINY_VARIANTS[name]
    abstract = jax.eval_shape(functools.partial(init_weights, cfg, scale=0.2), jax.random.key(0))
    rng = np.random.default_rng(seed)

    def fill(path, a):
        key = jax.tree_util.keystr(path)
        if "norm" in key:
            x = 1.0 + 0.1 * rng.standard_normal(a.shape)
        else:
            x = (1.0 if key == ".embed" else 0.2) * rng.standard_normal(a.shape)
        return jnp.asarray(x, a.dtype)

    return Model(config=cfg, weights=jax.tree_util.tree_map_with_path(fill, abstract), name=name)


def pad_prompts(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded i32[B, P] ids and i32[B] lengths."""
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    return ids, np.asarray([len(p) for p in prompts], np.int32)


def assert_second_call_compiles_nothing(model, prompts: list[list[int]], **kw) -> None:
    """`jspec.generate(model, prompts, **kw)`, then the same call on other prompts (other
    lengths, one batch of 4) with another key: the second compiles nothing."""
    from jspec.decode import _generate

    jspec.generate(model, *pad_prompts(prompts), key=jax.random.key(2),
                   **kw).tokens.block_until_ready()
    before = _generate._cache_size()
    ids, lens = pad_prompts([[40, 41, 42], [50], [3, 4], [60, 61, 62, 63]])
    jspec.generate(model, ids, lens, key=jax.random.key(3), **kw).tokens.block_until_ready()
    assert _generate._cache_size() == before


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop each test module's compiled programs when it ends: the default run compiles
    hundreds of programs in one process, and the full run segfaulted inside XLA:CPU's compiler
    after test_libraspec's large-batch programs (not reproducible with fewer modules)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def real_model() -> Model:
    """SmolLM2-135M-Instruct, converted once into $JSPEC_CACHE."""
    return jspec.load_model("smollm2-135m")


def needs_libtpu() -> pytest.MarkDecorator:
    """Skip a TPU-compile test where libtpu is not installed (a checkout without the `tpu`
    extra); under CI (`$CI` set) its absence is an error, as in tests/test_aot_report.py."""
    missing = importlib.util.find_spec("libtpu") is None
    if missing and os.environ.get("CI"):
        raise RuntimeError("libtpu is missing: .ci/run installs the 'tpu' extra")
    return pytest.mark.skipif(missing, reason="libtpu not installed (pip install -e '.[tpu]')")
