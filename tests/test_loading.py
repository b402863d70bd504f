"""Loading weights: HF safetensors directories and GGUF files round-trip, bad input fails clearly."""

from __future__ import annotations

import functools
import json
import math

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_VARIANTS

import jspec
from jspec.models import KVCache, ModelConfig, forward, init_weights
from jspec.models.loading import (
    permute_qk,
    read_gguf,
    unpermute_qk,
    weights_from_hf,
    weights_to_hf,
    write_hf_dir,
)
from jspec.models.model import Model

T = 8
TOKENS = np.array([[3, 17, 42, 5, 96, 0, 61, 8]], np.int32)


@functools.partial(jax.jit, static_argnums=0,
                   compiler_options={"xla_backend_optimization_level": 0})
def _logits(cfg: ModelConfig, weights, tokens):
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return forward(cfg, weights, tokens, pos, KVCache.create(cfg, tokens.shape[0], T)).logits


def logits(model: Model) -> np.ndarray:
    return np.asarray(_logits(model.config, model.weights, TOKENS))


@functools.cache
def random_model(name: str, seed: int = 2) -> Model:
    """A tiny model filled by numpy (jax.random compiles per shape, slow on a small CPU)."""
    cfg = TINY_VARIANTS[name]
    abstract = jax.eval_shape(functools.partial(init_weights, cfg), jax.random.key(0))
    rng = np.random.default_rng(seed)

    def fill(path, a):
        key = jax.tree_util.keystr(path)
        x = 1.0 + 0.1 * rng.standard_normal(a.shape) if "norm" in key else \
            (1.0 if key == ".embed" else 0.2) * rng.standard_normal(a.shape)
        return jnp.asarray(x, a.dtype)

    return Model(config=cfg, weights=jax.tree_util.tree_map_with_path(fill, abstract), name=name)


def assert_same_weights(a, b):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb, strict=True):
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


# --------------------------------------------------------------------------------------------
# Hugging Face directories
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TINY_VARIANTS))
def test_hf_dir_round_trip(name, tmp_path):
    model = random_model(name)
    cfg = model.config
    tensors = weights_to_hf(cfg, model.weights)
    # HF layout: (out, in) projections
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (
        cfg.num_heads * cfg.head_dim, cfg.hidden_size)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (cfg.hidden_size, cfg.ffn_size)
    assert ("lm_head.weight" in tensors) == (not cfg.tie_embeddings)
    write_hf_dir(tmp_path, cfg, tensors)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["model_type"] == cfg.arch and hf_cfg["num_hidden_layers"] == cfg.num_layers

    loaded = jspec.load_model(tmp_path)
    assert loaded.config == cfg
    assert loaded.tokenizer is None
    assert_same_weights(loaded.weights, model.weights)
    np.testing.assert_array_equal(logits(loaded), logits(model))


def test_hf_dir_load_as_bfloat16(tmp_path):
    model = random_model("qwen3_qknorm")
    write_hf_dir(tmp_path, model.config, weights_to_hf(model.config, model.weights))
    bf = jspec.load_model(str(tmp_path), dtype="bfloat16")
    assert bf.config == model.config.replace(dtype="bfloat16")
    assert bf.weights.layers[0].wq.dtype == jnp.bfloat16 and bf.weights.embed.dtype == jnp.bfloat16
    assert bf.weights.layers[0].q_norm.dtype == jnp.float32
    assert bf.weights.final_norm.dtype == jnp.float32


def test_hf_rope_parameters_style_config(tmp_path):
    """transformers 5 writes `rope_parameters` instead of rope_theta / rope_scaling."""
    model = random_model("llama_mqa_scaled")
    cfg = model.config
    write_hf_dir(tmp_path, cfg, weights_to_hf(cfg, model.weights))
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    scaling = hf_cfg.pop("rope_scaling")
    hf_cfg["rope_parameters"] = {"rope_theta": hf_cfg.pop("rope_theta"), **scaling}
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    assert jspec.load_model(tmp_path).config == cfg


# --------------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------------

_GGUF_LAYER = {  # llama.cpp tensor names (per block) for the HF names
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_gguf(path, cfg: ModelConfig, weights, *, arch: str | None = None, permute: bool | None = None,
               skip_meta: tuple[str, ...] = (), override: dict[str, np.ndarray] | None = None) -> None:
    """A float32 GGUF laid out as llama.cpp's converter would (Q/K rows permuted for llama)."""
    arch = arch or cfg.arch
    permute = arch == "llama" if permute is None else permute
    hf = weights_to_hf(cfg, weights)
    w = gguf.GGUFWriter(str(path), arch)
    meta = {
        "block_count": lambda: w.add_block_count(cfg.num_layers),
        "context_length": lambda: w.add_context_length(cfg.max_position),
        "embedding_length": lambda: w.add_embedding_length(cfg.hidden_size),
        "feed_forward_length": lambda: w.add_feed_forward_length(cfg.ffn_size),
        "head_count": lambda: w.add_head_count(cfg.num_heads),
        "head_count_kv": lambda: w.add_head_count_kv(cfg.num_kv_heads),
        "key_length": lambda: w.add_key_length(cfg.head_dim),
        "value_length": lambda: w.add_value_length(cfg.head_dim),
        "rope_freq_base": lambda: w.add_rope_freq_base(cfg.rope_theta),
        "rms_eps": lambda: w.add_layer_norm_rms_eps(cfg.rms_eps),
        "vocab_size": lambda: w.add_vocab_size(cfg.vocab_size),
        "eos": lambda: cfg.eos_ids and w.add_eos_token_id(cfg.eos_ids[0]),
    }
    for key, add in meta.items():
        if key not in skip_meta:
            add()
    out = {"token_embd.weight": hf["model.embed_tokens.weight"],
           "output_norm.weight": hf["model.norm.weight"]}
    if "lm_head.weight" in hf:
        out["output.weight"] = hf["lm_head.weight"]
    for i in range(cfg.num_layers):
        for hf_suffix, gguf_suffix in _GGUF_LAYER.items():
            a = hf.get(f"model.layers.{i}.{hf_suffix}")
            if a is None:
                continue
            if permute and hf_suffix == "self_attn.q_proj.weight":
                a = permute_qk(a, cfg.num_heads)
            elif permute and hf_suffix == "self_attn.k_proj.weight":
                a = permute_qk(a, cfg.num_kv_heads)
            out[f"blk.{i}.{gguf_suffix}"] = a
    out.update(override or {})
    for name, a in out.items():
        w.add_tensor(name, np.ascontiguousarray(a, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_shape_convention(tmp_path):
    """GGUF stores dims reversed (ne[0] = columns); numpy (out, in) must come back as (out, in)."""
    cfg = TINY_VARIANTS["llama_untied_mha"]
    model = random_model("llama_untied_mha")
    path = tmp_path / "m.gguf"
    write_gguf(path, cfg, model.weights, permute=False)
    reader = gguf.GGUFReader(str(path))
    t = {t.name: t for t in reader.tensors}["blk.0.ffn_down.weight"]
    assert [int(s) for s in t.shape] == [cfg.ffn_size, cfg.hidden_size]  # (in, out) = ne order
    _, tensors, _ = read_gguf(path, undo_qk_permutation=False)
    hf = weights_to_hf(cfg, model.weights)
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.gate_proj.weight",
                 "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert tensors[name].shape == hf[name].shape, name
        np.testing.assert_array_equal(tensors[name], hf[name])


def _interleaved_rope(x: np.ndarray, pos: int, inv: np.ndarray) -> np.ndarray:
    """llama.cpp's (GPT-J style) RoPE on one head: pair (2i, 2i+1) rotates by pos * inv[i]."""
    out = x.copy()
    for i, f in enumerate(inv):
        c, s = math.cos(pos * f), math.sin(pos * f)
        out[2 * i], out[2 * i + 1] = x[2 * i] * c - x[2 * i + 1] * s, x[2 * i + 1] * c + x[2 * i] * s
    return out


def _rotate_half_rope(x: np.ndarray, pos: int, inv: np.ndarray) -> np.ndarray:
    """HF's RoPE on one head: pair (i, i + hd/2) rotates by pos * inv[i]."""
    half = len(x) // 2
    out = x.copy()
    for i, f in enumerate(inv):
        c, s = math.cos(pos * f), math.sin(pos * f)
        out[i], out[i + half] = x[i] * c - x[i + half] * s, x[i + half] * c + x[i] * s
    return out


def test_permute_qk_is_llama_cpp_convention():
    """Permuted rows under interleaved RoPE give the same dot products as HF rows under rotate-half."""
    n_head, hd, d = 3, 8, 5
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_head * hd, d))
    x = rng.standard_normal(d)
    inv = 1.0 / 10000 ** (np.arange(0, hd, 2) / hd)
    pw = permute_qk(w, n_head)
    np.testing.assert_array_equal(unpermute_qk(pw, n_head), w)
    for h in range(n_head):
        rows = slice(h * hd, (h + 1) * hd)
        hf_q = _rotate_half_rope(w[rows] @ x, 7, inv)
        cpp_q = _interleaved_rope(pw[rows] @ x, 7, inv)
        # the same rotated vector, with its components in interleaved order
        np.testing.assert_allclose(cpp_q[0::2], hf_q[:hd // 2], atol=1e-12)
        np.testing.assert_allclose(cpp_q[1::2], hf_q[hd // 2:], atol=1e-12)
    # biases (1-D) permute the same way as rows
    b = rng.standard_normal(n_head * hd)
    np.testing.assert_array_equal(permute_qk(b[:, None], n_head)[:, 0], permute_qk(b, n_head))


@pytest.mark.parametrize("name", ["llama_tied_gqa2", "llama_untied_mha"])
def test_gguf_llama_round_trip(name, tmp_path):
    model = random_model(name)
    cfg = model.config
    path = tmp_path / "tiny.gguf"
    write_gguf(path, cfg, model.weights)
    loaded = jspec.load_model(path)
    assert loaded.tokenizer is None and loaded.name == str(path)
    assert loaded.config.rms_eps == pytest.approx(cfg.rms_eps, rel=1e-6)  # stored as float32
    assert loaded.config == cfg.replace(rms_eps=loaded.config.rms_eps)
    assert_same_weights(loaded.weights, model.weights)
    want = logits(model)
    np.testing.assert_allclose(logits(loaded), want, rtol=1e-5, atol=1e-5)

    # Without undoing llama.cpp's Q/K permutation the model is a different (broken) one.
    config, tensors, _ = read_gguf(path, undo_qk_permutation=False)
    broken = Model(config=config, weights=weights_from_hf(config, tensors))
    assert np.abs(logits(broken) - want).max() > 0.1 * np.abs(want).max()


@pytest.mark.parametrize("name", ["qwen2_bias", "qwen3_qknorm"])
def test_gguf_qwen_is_not_unpermuted(name, tmp_path):
    """Qwen GGUFs keep HF's row order (NeoX RoPE): the loader must not unpermute them."""
    model = random_model(name)
    cfg = model.config
    path = tmp_path / "qwen.gguf"
    write_gguf(path, cfg, model.weights)  # no permutation for qwen archs
    loaded = jspec.load_model(path)
    assert loaded.config.arch == cfg.arch
    assert loaded.config.qkv_bias == cfg.qkv_bias and loaded.config.qk_norm == cfg.qk_norm
    assert loaded.config.head_dim == cfg.head_dim and loaded.config.rope_theta == cfg.rope_theta
    assert loaded.config == cfg.replace(rms_eps=loaded.config.rms_eps)
    assert_same_weights(loaded.weights, model.weights)
    np.testing.assert_allclose(logits(loaded), logits(model), rtol=1e-5, atol=1e-5)


