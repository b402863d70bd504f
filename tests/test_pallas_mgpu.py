"""The Mosaic GPU kernels on a machine without a GPU: what can be checked here.

Their numbers are checked on a GPU by `python -m pallas_kernels.bench` (docs/BENCHMARKS.md). Here:
the ancestor words the tree kernel reads equal the reference's ancestor relation, both kernels
lower to Mosaic GPU for CUDA at every size the device check runs (a lowering error would otherwise
surface only on a GPU), and the GPU-only input limits raise clear errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import bench
from pallas_kernels.relaxed_acceptance.kernel_mgpu import relaxed_acceptance_mgpu
from pallas_kernels.tree_attention.kernel_mgpu import (
    ancestor_words,
    check_mgpu_inputs,
    tree_attention_mgpu,
)
from pallas_kernels.tree_attention.tuned_block_sizes import pick_block_kv_gpu


def _ancestors_brute(parents: np.ndarray) -> np.ndarray:
    b, t = parents.shape
    anc = np.zeros((b, t, t), bool)
    for r in range(b):
        for i in range(t):
            u = i
            while u >= 0:
                anc[r, i, u] = True
                u = parents[r, u]
    return anc


@pytest.mark.parametrize("t", [1, 5, 31, 32, 33, 64])
def test_ancestor_words_equal_brute_force(t):
    rng = np.random.default_rng(t)
    parents = np.stack([[-1] + [int(rng.integers(-1, i)) for i in range(1, t)] for _ in range(3)])
    parents[0] = np.arange(t) - 1  # a chain: the deepest tree of t nodes
    lo, hi = jax.jit(ancestor_words, static_argnums=1)(jnp.asarray(parents, jnp.int32), t)
    lo = np.asarray(lo).astype(np.uint32).astype(np.uint64)
    hi = np.asarray(hi).astype(np.uint32).astype(np.uint64)
    words = lo | (hi << np.uint64(32))
    bits = ((words[..., None] >> np.arange(t, dtype=np.uint64)) & np.uint64(1)).astype(bool)
    np.testing.assert_array_equal(bits, _ancestors_brute(parents))


def _lower_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("cfg", bench.attention_configs(True, "gpu")
                         + bench.attention_configs(False, "gpu")[:2],
                         ids=lambda c: "t{t}h{h}kv{kv}hd{hd}s{s}{dtype}".format(**c))
def test_tree_attention_lowers_for_cuda(cfg):
    b, t, h, kv, hd, s = cfg["b"], cfg["t"], cfg["h"], cfg["kv"], cfg["hd"], cfg["s"]
    dt = jnp.dtype(cfg["dtype"])
    sd = jax.ShapeDtypeStruct
    args = (sd((b, t, h, hd), dt), sd((b, kv, s, hd), dt), sd((b, kv, s, hd), dt),
            sd((b,), jnp.int32), sd((b, t, kv, hd), dt), sd((b, t, kv, hd), dt),
            sd((b, t), jnp.int32))
    bk = pick_block_kv_gpu(s, hd)
    text = _lower_cuda(lambda *a: tree_attention_mgpu(*a, sm_scale=hd ** -0.5, block_kv=bk), *args)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("cfg", bench.acceptance_configs(True, "gpu")
                         + bench.acceptance_configs(False, "gpu"),
                         ids=lambda c: "B{b}K{k}V{v}T{temperature}w{w}oh{one_hot}{dtype}".format(**c))
def test_relaxed_acceptance_lowers_for_cuda(cfg):
    b, k, v = cfg["b"], cfg["k"], cfg["v"]
    sd = jax.ShapeDtypeStruct
    q = None if cfg["one_hot"] else sd((b, k, v), jnp.float32)
    args = (sd((b, k + 1, v), jnp.dtype(cfg["dtype"])), sd((b, k), jnp.int32), q,
            sd((b, k), jnp.int32), sd((b, k), jnp.float32), sd((b,), jnp.float32),
            sd((b, v), jnp.float32))
    text = _lower_cuda(lambda *a: relaxed_acceptance_mgpu(
        *a, temperature=cfg["temperature"], block_v=2048 if v >= 2048 else 512,
        num_splits=None, weighted=cfg["w"] is not None), *args)
    assert text.count("mosaic_gpu") >= 1


def test_gpu_limits_raise_clear_errors():
    q = jnp.zeros((1, 4, 4, 64), jnp.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        check_mgpu_inputs(q, 128, 256)
    with pytest.raises(ValueError, match="head_dim 64 or 128"):
        check_mgpu_inputs(jnp.zeros((1, 4, 4, 48), jnp.bfloat16), 128, 256)
    with pytest.raises(ValueError, match="at most 64 tree nodes"):
        check_mgpu_inputs(jnp.zeros((1, 65, 4, 64), jnp.bfloat16), 128, 256)
    with pytest.raises(ValueError, match="block_kv"):
        check_mgpu_inputs(jnp.zeros((1, 4, 4, 64), jnp.bfloat16), 96, 192)
    with pytest.raises(ValueError, match="multiple of 512"):
        relaxed_acceptance_mgpu(jnp.zeros((1, 3, 4096)), jnp.zeros((1, 2), jnp.int32), None,
                                jnp.ones((1, 2), jnp.int32), jnp.zeros((1, 2)), jnp.ones((1,)),
                                None, temperature=0.0, block_v=1000, num_splits=None,
                                weighted=False)


def test_gpu_kernel_supports_matches_the_checks():
    from pallas_kernels.tree_attention.kernel_mgpu import gpu_kernel_supports

    assert gpu_kernel_supports(16, 64, 1024, jnp.bfloat16)
    assert gpu_kernel_supports(64, 128, 4096, jnp.float16)
    assert not gpu_kernel_supports(16, 64, 1024, jnp.float32)  # "auto" takes XLA there
    assert not gpu_kernel_supports(65, 64, 1024, jnp.bfloat16)
    assert not gpu_kernel_supports(16, 96, 1024, jnp.bfloat16)
    assert not gpu_kernel_supports(16, 64, 1000, jnp.bfloat16)
    for t, hd, s, dt in [(16, 64, 1024, jnp.bfloat16), (65, 64, 1024, jnp.bfloat16),
                         (16, 64, 1000, jnp.bfloat16), (4, 128, 256, jnp.float32)]:
        ok = gpu_kernel_supports(t, hd, s, dt)
        try:
            check_mgpu_inputs(jnp.zeros((1, t, 2, hd), dt), pick_block_kv_gpu(s, hd), s)
            raised = False
        except ValueError:
            raised = True
        assert ok != raised, (t, hd, s, dt)
