"""`repeat_kv_heads`: the same model with KV heads repeated, for tensor-parallel widths larger
than the KV heads (e.g. 8 KV heads on 16 TPU chips)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import pad_prompts, tiny_model

import jspec
from jspec.models.cache import KVCache
from jspec.models.llama import forward, repeat_kv_heads
from jspec.models.model import Model


@pytest.mark.parametrize("name", ["llama_tied_gqa2", "qwen2_bias", "mesh_gqa"])
def test_repeated_kv_heads_are_the_same_model(name):
    model = tiny_model(name)
    g = model.config.num_heads // model.config.num_kv_heads
    cfg, w = repeat_kv_heads(model.config, model.weights, g)
    assert cfg.num_kv_heads == model.config.num_heads
    ids, lens = pad_prompts([[5, 6, 7, 8, 9], [3, 4]])
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    a = forward(model.config, model.weights, jnp.asarray(ids), pos,
                KVCache.create(model.config, 2, 32)).logits
    b = forward(cfg, w, jnp.asarray(ids), pos, KVCache.create(cfg, 2, 32)).logits
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5, rtol=1e-5)
    if name != "llama_tied_gqa2":
        return
    out = jspec.generate(Model(config=cfg, weights=w), ids, lens, max_new_tokens=10)
    ref = jspec.generate(model, ids, lens, max_new_tokens=10)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))


def test_repeat_factor_must_divide_the_group():
    model = tiny_model("llama_tied_gqa2")  # 4 query heads on 2 KV heads: G = 2
    with pytest.raises(ValueError, match="must divide"):
        repeat_kv_heads(model.config, model.weights, 3)
    assert repeat_kv_heads(model.config, model.weights, 1)[0] is model.config
