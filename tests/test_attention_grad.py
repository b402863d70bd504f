"""Gradients through a forward that runs the Pallas attention kernel: the kernel's tangents
are the XLA reference's (a Pallas call has no derivative rule), so a loss inside the user's jit
(a policy gradient on the rollout) differentiates on every platform."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_libtpu

from jspec.models.cache import KVCache
from jspec.models.config import ModelConfig
from jspec.models.llama import forward, init_weights, stack_layers

TOKS = jax.random.randint(jax.random.key(1), (2, 5), 0, 256)
POS = jnp.broadcast_to(jnp.arange(5), (2, 5))


def loss(cfg: ModelConfig, w, lengths=(3, 0)) -> jax.Array:
    cache = KVCache.create(cfg, 2, 32).with_lengths(jnp.asarray(lengths, jnp.int32))
    return (forward(cfg, w, TOKS, POS, cache).logits ** 2).mean()


@pytest.mark.parametrize("scan", [False, True])
def test_grad_through_the_kernel_equals_grad_through_xla(scan):
    """float32, tolerance 1e-5: the Pallas path (interpret mode here) and the XLA path give the
    same gradient of every weight, per-layer or scanned layers; rows with and without a
    committed prefix."""
    base = ModelConfig(num_layers=2, scan_layers=scan)
    w = init_weights(base, jax.random.key(0))
    grads = [jax.jit(jax.grad(functools.partial(loss, base.replace(attention_impl=impl))))(w)
             for impl in ("xla", "pallas")]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads[1])) > 0


@needs_libtpu()
def test_grad_compiles_for_tpu_with_the_mosaic_kernel():
    """The same gradient, bfloat16, scanned layers, compiled for a v5e chip: the forward keeps
    the Mosaic kernel, the backward is XLA."""
    from jspec.aot.chips import tpu_devices

    cfg = ModelConfig(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128,
                      ffn_size=512, dtype="bfloat16", scan_layers=True)
    sh = jax.sharding.SingleDeviceSharding(tpu_devices("v5e:1x1")[0])
    w = jax.eval_shape(lambda: stack_layers(init_weights(cfg, jax.random.key(0))))
    w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), w)
    hlo = jax.jit(jax.grad(functools.partial(loss, cfg))).lower(w).compile().as_text()
    assert 'custom_call_target="tpu_custom_call"' in hlo
