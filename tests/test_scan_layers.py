"""Scanned layers (`ModelConfig.scan_layers`: stacked weights, a `lax.scan` over them, one
stacked KV cache): the same model as the unrolled layout, to float32 rounding, in every
forward mode and in `generate`; the stacked cache writes; sharding of stacked leaves; the HLO
traffic model of a while loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_libtpu

import jspec
from jspec.models.cache import KVCache, write_slots, write_stack
from jspec.models.config import ModelConfig
from jspec.models.llama import Tree, forward, init_weights, stack_layers, unstack_layers
from jspec.models.model import Model


def models(impl: str = "xla", layers: int = 3) -> tuple[Model, Model]:
    cfg = ModelConfig(num_layers=layers, attention_impl=impl)
    m = Model(config=cfg, weights=init_weights(cfg, jax.random.key(0)))
    return m, m.with_scan_layers()


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_forward_equals_unrolled(impl):
    """Prefill with hidden states (embeddings and layers), a tree verify that leaves the cache
    unwritten (new K/V returned) then written, and an early-exit forward of the first 2 layers:
    every output equal to the unrolled model's (tolerance 1e-5, float32)."""
    toks = jax.random.randint(jax.random.key(1), (2, 5), 0, 256)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    got = []
    for m in models(impl):
        cfg, w = m.config, m.weights
        o = forward(cfg, w, toks, pos, KVCache.create(cfg, 2, 32), hidden_layers=(0, 2, 3))
        c = o.cache.with_lengths(jnp.array([5, 3]))
        v = forward(cfg, w, toks[:, :3], pos[:, :3] + 5, c, mask=Tree(jnp.array([-1, 0, 0])),
                    hidden_layers=(1,), write_cache=False)
        e = forward(cfg, w, toks[:, :1], pos[:, :1] + 5, c, num_layers=2, hidden_layers=(2,))
        written = c.write(*v.new_kv)
        layer1 = written.k[1]  # a stack and a tuple index alike
        got.append([o.logits, o.hidden, v.logits, v.hidden, *v.new_kv, e.logits, e.hidden,
                    layer1, e.cache.k[0]])
    for a, b in zip(*got, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=1e-5)


@pytest.mark.parametrize("drafter", [None, "ngram", "early-exit:2+topk:nodes=6"])
def test_generate_equals_unrolled(drafter):
    """Same key, same tokens and log-probs: plain decoding, an n-gram chain and an early-exit
    drawn tree (whose drafter runs the target's first layers from the stack) at T = 1."""
    ids = jax.random.randint(jax.random.key(2), (2, 8), 0, 256)
    lens = jnp.array([8, 6])
    outs = []
    for m in models(layers=4):
        d = jspec.load_drafter(drafter, target=m) if drafter else None
        g = jspec.generate(m, ids, lens, drafter=d, max_new_tokens=12, key=jax.random.key(3),
                           sampling=jspec.Sampling(temperature=1.0))
        outs.append(g)
    np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
    np.testing.assert_allclose(np.asarray(outs[0].logprobs), np.asarray(outs[1].logprobs),
                               atol=1e-4)


def test_layouts_convert_both_ways_and_mismatch_is_an_error():
    m, s = models()
    assert isinstance(s.weights.layers, type(m.weights.layers[0]))
    assert s.weights.layers.wq.shape == (3, *m.weights.layers[0].wq.shape)
    back = unstack_layers(stack_layers(m.weights))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(m.weights), strict=True):
        np.testing.assert_array_equal(a, b)
    assert s.with_scan_layers(False).config.scan_layers is False
    toks = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="scan_layers"):
        forward(s.config, m.weights, toks, toks, KVCache.create(s.config, 1, 8))
    with pytest.raises(ValueError, match="scan_layers"):
        forward(m.config, m.weights, toks, toks, KVCache.create(s.config, 1, 8))


@pytest.mark.parametrize("layers_written", [2, 3])
def test_stack_writes_equal_per_layer_writes(layers_written):
    """Every layer's slots written in one scatter (a row near the end of the buffer drops
    slots past it) equal per-layer `write_slots`; layers beyond the new K/V's keep theirs."""
    buf = jax.random.normal(jax.random.key(0), (3, 2, 2, 8, 4))
    new = jax.random.normal(jax.random.key(1), (layers_written, 2, 3, 2, 4))
    start = jnp.array([6, 2])
    want = buf
    for i in range(layers_written):
        want = want.at[i].set(write_slots(buf[i], new[i], start))
    np.testing.assert_array_equal(np.asarray(write_stack(buf, new, start)), np.asarray(want))


def test_stacked_leaves_shard_like_their_layers():
    """A stackable field's stack keeps its declared axes behind an unsharded leading axis;
    declared axes of other fields are unchanged."""
    from jspec import sharding

    mesh = jax.sharding.AbstractMesh((1, 4), ("data", "model"))
    cfg = ModelConfig(num_layers=2, num_heads=4, num_kv_heads=4, hidden_size=64, head_dim=16)
    w = jax.eval_shape(lambda: stack_layers(init_weights(cfg, jax.random.key(0))))
    specs = sharding.param_specs(w, mesh, head_dim=16)
    assert specs.layers.wq == jax.sharding.PartitionSpec(None, None, "model")
    assert specs.layers.w_down == jax.sharding.PartitionSpec(None, "model")
    assert specs.embed == jax.sharding.PartitionSpec("model")
    cache = jax.eval_shape(lambda: KVCache.create(cfg.replace(scan_layers=True), 4, 16))
    cs = sharding.state_specs(cache, jax.sharding.AbstractMesh((2, 4), ("data", "model")),
                              batch=4)
    assert cs.k == jax.sharding.PartitionSpec(None, "data", "model")
    assert cs.lengths == jax.sharding.PartitionSpec("data")


@needs_libtpu()
def test_while_loop_traffic_counts_its_body_per_trip():
    """The HLO traffic model of a scanned program compiled for TPU: a loop of 4 matmuls reads
    the stacked weights once in all (4 trips x one layer), like the unrolled program, not 4x
    nor 1/4 of it (tolerance 5%)."""
    from jspec.aot.chips import tpu_devices
    from jspec.aot.hlo import hbm_traffic

    dev = tpu_devices("v5e:1x1")[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    ws = jax.ShapeDtypeStruct((4, 1024, 1024), jnp.bfloat16, sharding=sh)
    x = jax.ShapeDtypeStruct((8, 1024), jnp.bfloat16, sharding=sh)

    def scanned(ws, x):
        return jax.lax.scan(lambda h, w: ((h @ w).astype(h.dtype), None), x, ws)[0]

    def unrolled(ws, x):
        for i in range(4):
            x = (x @ ws[i]).astype(x.dtype)
        return x

    reads = [hbm_traffic(jax.jit(f).lower(ws, x).compile().as_text())["hbm_read_bytes"]
             for f in (scanned, unrolled)]
    weights = 4 * 1024 * 1024 * 2
    assert 0.95 * weights <= reads[0] <= 1.05 * weights + 1e5, reads
    assert abs(reads[0] - reads[1]) <= 0.05 * weights, reads


def test_real_model_scanned_generates_the_same_tokens(real_model):
    """SmolLM2-135M (30 layers) scanned: greedy plain and n-gram speculative decoding give the
    unrolled model's tokens (and the second call compiles nothing)."""
    from conftest import assert_second_call_compiles_nothing, pad_prompts

    scanned = real_model.with_scan_layers()
    prompts = [real_model.encode("Name three prime numbers."),
               real_model.encode("What is 12 times 7?")]
    ids, lens = pad_prompts(prompts)
    for drafter in (None, "ngram"):
        outs = []
        for m in (real_model, scanned):
            d = jspec.load_drafter(drafter, target=m) if drafter else None
            outs.append(np.asarray(jspec.generate(m, ids, lens, drafter=d,
                                                  max_new_tokens=24).tokens))
        np.testing.assert_array_equal(outs[0], outs[1])
    # A batch of 4 short prompts, as the helper's second call.
    assert_second_call_compiles_nothing(scanned, [[1, 2, 3], [5, 6], [7], [8, 9, 10, 11]],
                                        max_new_tokens=24,
                                        drafter=jspec.load_drafter("ngram", target=scanned))
