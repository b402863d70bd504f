"""Loading weights: HF safetensors directories and GGUF files round-trip, bad input fails clearly."""

from __future__ import annotations

import functools
import json
import math
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

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

PATHS_PY = Path(jspec.__file__).parent / "paths.py"
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


# --------------------------------------------------------------------------------------------
# Bad input: always a ModelLoadError (a JspecError, a ValueError) that says what is wrong
# --------------------------------------------------------------------------------------------

def test_model_load_error_hierarchy():
    assert issubclass(jspec.ModelLoadError, jspec.JspecError)
    assert issubclass(jspec.ModelLoadError, ValueError)


def test_unknown_model_name():
    with pytest.raises(jspec.ModelLoadError, match=r"unknown model 'no-such-model'.*smollm2-135m"):
        jspec.load_model("no-such-model")


def test_missing_gguf_path(tmp_path):
    with pytest.raises(jspec.ModelLoadError, match="not found"):
        jspec.load_model(tmp_path / "missing.gguf")


def _valid_gguf(tmp_path, name="llama_tied_gqa2", **kw):
    path = tmp_path / "model.gguf"
    model = random_model(name)
    write_gguf(path, model.config, model.weights, **kw)
    return path


def test_truncated_gguf(tmp_path):
    path = _valid_gguf(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(jspec.ModelLoadError, match="truncated"):
        jspec.load_model(path)


@pytest.mark.parametrize("content", [b"", b"GGUF", b"this is not a GGUF file\n" * 20])
@pytest.mark.parametrize("filename", ["model.gguf", "model.bin"])
def test_not_a_gguf_file(tmp_path, content, filename):
    path = tmp_path / filename
    path.write_bytes(content)
    with pytest.raises(jspec.ModelLoadError, match="cannot read GGUF"):
        jspec.load_model(path)


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(jspec.ModelLoadError, match=r"architecture 'gpt2'.*llama"):
        jspec.load_model(path)


def test_gguf_missing_metadata(tmp_path):
    path = _valid_gguf(tmp_path, skip_meta=("head_count",))
    with pytest.raises(jspec.ModelLoadError, match=r"llama\.attention\.head_count"):
        jspec.load_model(path)


def test_gguf_invalid_metadata(tmp_path):
    """4 query heads over 3 kv heads: ModelConfig rejects it; the loader says so as a ModelLoadError."""
    path2 = tmp_path / "bad2.gguf"
    w = gguf.GGUFWriter(str(path2), "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(48)
    w.add_head_count(4)
    w.add_head_count_kv(3)
    w.add_vocab_size(97)
    w.add_tensor("token_embd.weight", np.zeros((97, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(jspec.ModelLoadError, match="multiple of num_kv_heads"):
        jspec.load_model(path2)


def test_gguf_wrong_tensor_shape(tmp_path):
    cfg = TINY_VARIANTS["llama_tied_gqa2"]
    path = _valid_gguf(tmp_path, override={
        "blk.1.ffn_up.weight": np.zeros((cfg.ffn_size + 1, cfg.hidden_size), np.float32)})
    with pytest.raises(jspec.ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*shape"):
        jspec.load_model(path)


@pytest.fixture
def hf_dir(tmp_path):
    model = random_model("qwen2_bias")
    write_hf_dir(tmp_path, model.config, weights_to_hf(model.config, model.weights))
    return tmp_path


def test_hf_dir_without_config(hf_dir):
    (hf_dir / "config.json").unlink()
    with pytest.raises(jspec.ModelLoadError, match=r"no config\.json"):
        jspec.load_model(hf_dir)


def test_hf_dir_without_safetensors(hf_dir):
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(jspec.ModelLoadError, match=r"no \*\.safetensors"):
        jspec.load_model(hf_dir)


def test_hf_dir_truncated_safetensors(hf_dir):
    st = hf_dir / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    with pytest.raises(jspec.ModelLoadError, match="truncated or corrupt"):
        jspec.load_model(hf_dir)


def _edit_config(hf_dir, **changes):
    cfg = json.loads((hf_dir / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (hf_dir / "config.json").write_text(json.dumps(cfg))


def test_hf_dir_unsupported_model_type(hf_dir):
    _edit_config(hf_dir, model_type="gpt_neox")
    with pytest.raises(jspec.ModelLoadError, match=r"unsupported model_type 'gpt_neox'"):
        jspec.load_model(hf_dir)


@pytest.mark.parametrize("changes, match", [
    (dict(hidden_size=None), "hidden_size"),
    (dict(num_key_value_heads=3), "multiple of num_kv_heads"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
])
def test_hf_dir_bad_config_values(hf_dir, changes, match):
    _edit_config(hf_dir, **changes)
    with pytest.raises(jspec.ModelLoadError, match=match):
        jspec.load_model(hf_dir)


def test_hf_dir_config_not_json(hf_dir):
    (hf_dir / "config.json").write_text("{not json")
    with pytest.raises(jspec.ModelLoadError, match=r"bad config\.json"):
        jspec.load_model(hf_dir)


def _rewrite_tensors(hf_dir, edit):
    from safetensors.numpy import load_file, save_file

    st = hf_dir / "model.safetensors"
    tensors = load_file(str(st))
    edit(tensors)
    save_file(tensors, str(st))


def test_hf_dir_wrong_tensor_shape(hf_dir):
    name = "model.layers.0.self_attn.k_proj.weight"

    def transpose(t):
        t[name] = np.ascontiguousarray(t[name].T)
    _rewrite_tensors(hf_dir, transpose)
    with pytest.raises(jspec.ModelLoadError, match=rf"{name} has shape \(32, 16\), expected \(16, 32\)"):
        jspec.load_model(hf_dir)


def test_hf_dir_missing_tensor(hf_dir):
    name = "model.layers.1.self_attn.v_proj.bias"
    _rewrite_tensors(hf_dir, lambda t: t.pop(name))
    with pytest.raises(jspec.ModelLoadError, match=rf"missing tensor {name}"):
        jspec.load_model(hf_dir)


def test_cache_lock_serializes_processes(tmp_path):
    """Four processes take `cache_lock` on the same entry and each writes `start`, sleeps, then
    `end` to one file: with the lock the lines come in start/end pairs of one process; without
    it (`broken`: the same processes, no lock) they interleave, so the check can fail."""
    log = tmp_path / "log"
    # jspec/paths.py is a leaf module: loaded by file, each process starts in milliseconds, and
    # all four wait for one common start time.
    code = ("import contextlib, importlib.util, os, sys, time\n"
            f"spec = importlib.util.spec_from_file_location('paths', {str(PATHS_PY)!r})\n"
            "paths = importlib.util.module_from_spec(spec); spec.loader.exec_module(paths)\n"
            "lock = contextlib.nullcontext() if sys.argv[1] == 'broken' else paths.cache_lock('t')\n"
            "time.sleep(max(0.0, float(sys.argv[3]) - time.time()))\n"
            "with lock:\n"
            "    with open(sys.argv[2], 'a') as f: f.write(f'start {os.getpid()}\\n')\n"
            "    time.sleep(0.3)\n"
            "    with open(sys.argv[2], 'a') as f: f.write(f'end {os.getpid()}\\n')\n")
    env = dict(os.environ, JSPEC_CACHE=str(tmp_path / "cache"))

    def run(mode):
        log.write_text("")
        start = str(time.time() + 2.0)
        procs = [subprocess.Popen([sys.executable, "-c", code, mode, str(log), start], env=env)
                 for _ in range(4)]
        assert all(p.wait(timeout=120) == 0 for p in procs)
        lines = log.read_text().split()
        return [(lines[i], lines[i + 1]) for i in range(0, len(lines), 2)]

    pairs = run("locked")
    assert len(pairs) == 8
    assert all(pairs[i][0] == "start" and pairs[i + 1] == ("end", pairs[i][1])
               for i in range(0, 8, 2))
    pairs = run("broken")
    assert not all(pairs[i][0] == "start" and pairs[i + 1] == ("end", pairs[i][1])
                   for i in range(0, 8, 2))


def test_converted_entry_gets_the_umask_mode_not_a_private_one(tmp_path, monkeypatch):
    """A registry model converted into the cache is readable as the umask allows (0755 under
    022), not left at the 0700 of the temporary directory it was written in (the bug: a cache
    shared by several users was unreadable to all but the first)."""
    from jspec.models import registry

    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, random_model("llama_tied_gqa2").config,
               random_model("llama_tied_gqa2").weights)
    entry = registry.RegistryEntry(name="tiny-entry", package="none", module="none",
                                   member="none/tiny.gguf", wheel_sha256="",
                                   gguf_sha256=registry.sha256(gguf_path), description="")
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "fetch_gguf", lambda e, **kw: gguf_path)
    old = os.umask(0o022)
    try:
        out = registry.converted_dir(entry)
    finally:
        os.umask(old)
    assert out == tmp_path / "cache" / "models" / "tiny-entry"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert (out / "config.json").is_file() and (out / ".jspec-converted").is_file()
    assert [p.name for p in out.parent.iterdir()] == ["tiny-entry"]  # no temporary left
    assert registry.converted_dir(entry) == out  # converted once: the marker is read
