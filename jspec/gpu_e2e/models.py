"""Models and drafters for `python -m jspec.gpu_e2e`: random weights of a shape (drawn on the
device in their dtype), the shapes it times, and --tiny's stand-ins (drafters, tokenizer)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.drafters import d2sd, dflash, eagle3
from jspec.drafters.trained import DrafterConfig, from_flat, to_flat
from jspec.models import Model, ModelConfig, init_weights

# SmolLM2-135M-Instruct's shape: the autoregressive and c(K) rows fall back to random weights
# of this shape when the real model cannot be loaded (timings do not depend on the values).
SMOLLM2_SHAPE = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, num_layers=30,
                            num_heads=9, num_kv_heads=3, head_dim=64, ffn_size=1536,
                            rope_theta=100000.0, tie_embeddings=True, max_position=8192,
                            bos_id=1, eos_ids=(2,))
# Llama-3-8B: 32 layers, 4096 hidden, GQA 32 query / 8 KV heads of 128, FFN 14336, 128k vocab.
LLAMA3_8B = ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096, num_layers=32,
                        num_heads=32, num_kv_heads=8, head_dim=128, ffn_size=14336,
                        rope_theta=500000.0, tie_embeddings=False, max_position=131072)
# --tiny: the same code paths at sizes a 2-core CPU runs in about two minutes.
TINY_TARGET = ModelConfig(arch="llama", vocab_size=256, hidden_size=32, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, ffn_size=48, eos_ids=(1,))
TINY_LLAMA = ModelConfig(arch="llama", vocab_size=512, hidden_size=64, num_layers=2,
                         num_heads=8, num_kv_heads=2, head_dim=8, ffn_size=224,
                         tie_embeddings=False)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def normal(key: jax.Array, shape: tuple[int, ...], dtype: Any, scale: float) -> jax.Array:
    """dtype[shape] N(0, scale²) drawn directly in `dtype` on the default device."""
    return scale * jax.random.normal(key, shape, dtype)


def random_model(config: ModelConfig, seed: int = 0, scale: float = 0.02) -> Model:
    """A Model with random weights of `config`'s shape, built leaf by leaf on the device.

    `jax.eval_shape(init_weights)` gives the pytree without allocating it; each matrix is then
    drawn directly in its dtype (no float32 copy of an 8B model), norms are ones.
    """
    abstract = jax.eval_shape(functools.partial(init_weights, config), jax.random.key(0))
    key = jax.random.key(seed)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    leaves = []
    for i, (path, a) in enumerate(flat):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            leaves.append(jnp.ones(a.shape, a.dtype))
        else:
            leaves.append(normal(jax.random.fold_in(key, i), tuple(a.shape), a.dtype,
                                  1.0 if name == ".embed" else scale))
    return Model(config=config, weights=jax.tree_util.tree_unflatten(treedef, leaves),
                 name=f"random-{config.num_layers}L-{config.hidden_size}")


def param_bytes(config: ModelConfig) -> int:
    """Bytes of `config`'s weights, from `jax.eval_shape` (nothing allocated)."""
    abstract = jax.eval_shape(functools.partial(init_weights, config), jax.random.key(0))
    return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract)))


def tiny_drafters(target: Model) -> dict[str, Any]:
    """Random-weight EAGLE-3, DFlash and D²SD drafters of a tiny target, and the n-gram one.

    Shapes as in the tests' tiny drafters: one EAGLE-3 layer reading layers 0-2, two DFlash
    layers reading 1-2 with a block of 6 (D²SD: chain k <= 5, 4 branches of 1).
    """
    c = target.config

    def cfg(kind: str) -> DrafterConfig:
        return DrafterConfig(kind=kind, hidden_size=c.hidden_size, num_heads=4, num_kv_heads=2,
                             head_dim=8, ffn_size=40, num_layers=1 if kind == "eagle3" else 2,
                             feature_layers=(0, 1, 2) if kind == "eagle3" else (1, 2),
                             draft_vocab=64, target_vocab=c.vocab_size, rope_theta=c.rope_theta,
                             rms_eps=c.rms_eps, block=4 if kind == "eagle3" else 6,
                             target="tiny")

    rng = np.random.default_rng(3)

    def params(mod: Any, kind: str) -> Any:
        # The parameter shapes from `init_params` without running it (jax.random compiles per
        # shape: seconds on a small CPU), filled by numpy: norms and feature std one, feature
        # mean and verification head zero, matrices N(0, 1/fan_in), vectors N(0, 0.02²).
        shapes = jax.eval_shape(functools.partial(mod.init_params, cfg(kind)), jax.random.key(0))
        out = {}
        for name, a in to_flat(shapes).items():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in leaf or leaf == "feat_std":
                x = np.ones(a.shape)
            elif leaf == "feat_mean" or leaf.startswith("vh_"):
                x = np.zeros(a.shape)
            else:
                x = rng.standard_normal(a.shape) * (a.shape[0] ** -0.5 if a.ndim == 2 else 0.02)
            out[name] = jnp.asarray(x, a.dtype)
        return from_flat(kind, out)

    vocab = np.sort(np.random.default_rng(0).permutation(c.vocab_size)[:64])
    e3 = eagle3.make(cfg("eagle3"), params(eagle3, "eagle3"), vocab, target.weights,
                     name="tiny-eagle3")
    df = dflash.make(cfg("dflash"), params(dflash, "dflash"), vocab, target.weights,
                     name="tiny-dflash")
    tree = d2sd.make(df, dataclasses.replace(cfg("dflash"), kind="d2sd"), params(dflash, "dflash"),
                     vocab, target.weights, name="tiny-d2sd")
    return {"ngram": jspec.NGram(), "eagle3": e3, "dflash": df, "d2sd": tree}


def binary_parents(n: int) -> np.ndarray:
    """i32[n] parents of a complete binary tree of n nodes (node 0 the root, parent -1)."""
    return np.asarray([-1] + [(t - 1) // 2 for t in range(1, n)], np.int32)


def byte_encode(text: str, vocab: int, max_len: int = 24) -> list[int]:
    """--tiny's stand-in for a tokenizer: UTF-8 bytes mod the vocabulary, at most max_len."""
    ids = [2 + b % (vocab - 2) for b in text.encode()][:max_len]  # ids 0, 1 (EOS) unused
    return ids or [2]
