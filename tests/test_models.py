"""The Llama-family forward against an independent numpy reference, and its cache/mask contracts."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_VARIANTS, tiny_model

import jspec
from jspec.models import Chain, KVCache, ModelConfig, Tree, forward, init_weights
from jspec.models.llama import Weights, rms_norm, tree_ancestors
from jspec.models.model import Model

VARIANTS = sorted(TINY_VARIANTS)
RTOL = ATOL = 1e-4


# --------------------------------------------------------------------------------------------
# Independent numpy reference (float64, written from the architecture descriptions)
# --------------------------------------------------------------------------------------------

def ref_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies with linear / llama3 scaling, one frequency at a time."""
    hd = cfg.head_dim
    freqs = []
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling is not None else {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    for i in range(hd // 2):
        f = 1.0 / (cfg.rope_theta ** (2.0 * i / hd))
        if kind == "linear":
            f = f / scaling["factor"]
        elif kind == "llama3":
            factor = scaling["factor"]
            lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
            orig = scaling["original_max_position_embeddings"]
            wavelen = 2.0 * math.pi / f
            if wavelen < orig / hi:  # high frequency: unchanged
                pass
            elif wavelen > orig / lo:  # low frequency: divided by factor
                f = f / factor
            else:  # in between: interpolate
                s = (orig / wavelen - lo) / (hi - lo)
                f = (1.0 - s) * f / factor + s * f
        freqs.append(f)
    return np.array(freqs, np.float64)


def _np_weights(weights: Weights) -> Weights:
    return jax.tree.map(lambda a: np.asarray(a, np.float64), weights)


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, positions: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """x: [T, N, hd]; rotate-half: pair (i, i + hd/2) rotates by positions * inv[i]."""
    out = np.empty_like(x)
    half = x.shape[-1] // 2
    for t in range(x.shape[0]):
        for i in range(half):
            a = positions[t] * inv[i]
            c, s = math.cos(a), math.sin(a)
            x1, x2 = x[t, :, i], x[t, :, i + half]
            out[t, :, i] = x1 * c - x2 * s
            out[t, :, i + half] = x2 * c + x1 * s
    return out


def ref_forward(cfg: ModelConfig, weights: Weights, tokens, positions=None):
    """Logits [T, V] and hidden states [L+1, T, D] of one row, causal over `tokens`."""
    w = _np_weights(weights)
    tokens = np.asarray(tokens)
    t_len = len(tokens)
    positions = np.arange(t_len) if positions is None else np.asarray(positions)
    h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inv = ref_inv_freq(cfg)
    x = w.embed[tokens]
    hiddens = [x]
    lw = w.layers
    for layer in range(cfg.num_layers):
        y = _rmsnorm(x, lw.attn_norm[layer], cfg.rms_eps)
        q, k, v = y @ lw.wq[layer], y @ lw.wk[layer], y @ lw.wv[layer]
        if cfg.qkv_bias:
            q, k, v = q + lw.bq[layer], k + lw.bk[layer], v + lw.bv[layer]
        q = q.reshape(t_len, h, hd)
        k = k.reshape(t_len, kv, hd)
        v = v.reshape(t_len, kv, hd)
        if cfg.qk_norm:
            q = _rmsnorm(q, lw.q_norm[layer], cfg.rms_eps)
            k = _rmsnorm(k, lw.k_norm[layer], cfg.rms_eps)
        q, k = _rope(q, positions, inv), _rope(k, positions, inv)
        attn = np.zeros((t_len, h, hd))
        for head in range(h):
            kvh = head // (h // kv)
            for i in range(t_len):
                scores = np.array([q[i, head] @ k[j, kvh] for j in range(i + 1)]) / math.sqrt(hd)
                p = np.exp(scores - scores.max())
                p /= p.sum()
                attn[i, head] = p @ v[: i + 1, kvh]
        x = x + attn.reshape(t_len, h * hd) @ lw.wo[layer]
        y = _rmsnorm(x, lw.mlp_norm[layer], cfg.rms_eps)
        gate = y @ lw.w_gate[layer]
        x = x + (gate / (1.0 + np.exp(-gate)) * (y @ lw.w_up[layer])) @ lw.w_down[layer]
        hiddens.append(x)
    hn = _rmsnorm(x, w.final_norm, cfg.rms_eps)
    logits = hn @ (w.embed.T if w.lm_head is None else w.lm_head)
    return logits, np.stack(hiddens)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

@functools.cache
def _model(name: str) -> Model:
    return tiny_model(name, seed=1)


def _tokens(cfg: ModelConfig, shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=shape).astype(np.int32)


def _positions(start, t: int) -> jax.Array:
    start = jnp.atleast_1d(jnp.asarray(start, jnp.int32))
    return start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


def _full(model: Model, tokens, capacity: int = 32, **kw):
    tokens = jnp.asarray(tokens)
    b, t = tokens.shape
    cache = KVCache.create(model.config, b, capacity)
    return forward(model.config, model.weights, tokens, _positions(jnp.zeros(b), t), cache, **kw)


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------

def test_reference_inv_freq_matches_config():
    for name in VARIANTS:
        cfg = TINY_VARIANTS[name]
        np.testing.assert_allclose(cfg.inv_freq(), ref_inv_freq(cfg), rtol=1e-6)
    # The scaled variant exercises all three llama3 branches (kept / interpolated / divided).
    cfg = TINY_VARIANTS["llama_mqa_scaled"]
    base = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
    ratio = ref_inv_freq(cfg) / base
    assert ratio[0] == 1.0 and 1 / 8 < ratio[1] < 1.0 and np.allclose(ratio[2:], 1 / 8)


@pytest.mark.parametrize("name", VARIANTS)
def test_forward_matches_numpy_reference(name):
    model = _model(name)
    cfg = model.config
    tokens = _tokens(cfg, (2, 9), seed=3)
    out = _full(model, tokens)
    assert out.logits.shape == (2, 9, cfg.vocab_size) and out.logits.dtype == jnp.float32
    for b in range(2):
        ref, _ = ref_forward(cfg, model.weights, tokens[b])
        np.testing.assert_allclose(np.asarray(out.logits[b]), ref, rtol=RTOL, atol=ATOL)


def test_forward_matches_reference_at_offset_positions():
    model = _model("llama_mqa_scaled")
    cfg = model.config
    tokens = _tokens(cfg, (1, 6), seed=4)
    pos = jnp.arange(40, 46, dtype=jnp.int32)[None]
    out = forward(cfg, model.weights, jnp.asarray(tokens), pos, KVCache.create(cfg, 1, 8))
    ref, _ = ref_forward(cfg, model.weights, tokens[0], np.arange(40, 46))
    np.testing.assert_allclose(np.asarray(out.logits[0]), ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["llama_tied_gqa2", "qwen2_bias", "qwen3_qknorm"])
def test_incremental_decode_equals_full_forward(name):
    model = _model(name)
    cfg, w = model.config, model.weights
    n, p = 11, 4
    tokens = jnp.asarray(_tokens(cfg, (2, n), seed=5))
    full = _full(model, tokens).logits

    cache = KVCache.create(cfg, 2, 32)
    out = forward(cfg, w, tokens[:, :p], _positions(jnp.zeros(2), p), cache)
    np.testing.assert_allclose(out.logits, full[:, :p], rtol=RTOL, atol=ATOL)
    assert np.all(np.asarray(out.cache.lengths) == 0)  # forward never advances lengths
    cache = out.cache.with_lengths(out.cache.lengths + p)
    # one token at a time
    for i in range(p, 7):
        out = forward(cfg, w, tokens[:, i:i + 1], _positions(cache.lengths, 1), cache)
        np.testing.assert_allclose(out.logits[:, 0], full[:, i], rtol=RTOL, atol=ATOL)
        cache = out.cache.with_lengths(cache.lengths + 1)
    # then a multi-token chunk
    out = forward(cfg, w, tokens[:, 7:], _positions(cache.lengths, n - 7), cache)
    np.testing.assert_allclose(out.logits, full[:, 7:], rtol=RTOL, atol=ATOL)


def test_scratch_slots_beyond_length_are_ignored():
    """Garbage K/V past `lengths` (e.g. rejected drafts) must not affect the logits."""
    model = _model("llama_tied_gqa2")
    cfg, w = model.config, model.weights
    tokens = jnp.asarray(_tokens(cfg, (1, 8), seed=6))
    full = _full(model, tokens).logits
    # prefill 5 tokens but commit only 3: slots 3, 4 hold stale K/V of other tokens
    junk = tokens.at[:, 3:5].set(jnp.array([[11, 12]]))
    out = forward(cfg, w, junk[:, :5], _positions(0, 5), KVCache.create(cfg, 1, 16))
    cache = out.cache.with_lengths(jnp.array([3]))
    out = forward(cfg, w, tokens[:, 3:], _positions(3, 5), cache)
    np.testing.assert_allclose(out.logits, full[:, 3:], rtol=RTOL, atol=ATOL)


def test_batch_right_padding_and_ragged_lengths_match_single_rows():
    model = _model("llama_mqa_scaled")
    cfg, w = model.config, model.weights
    lens = [6, 3, 1]
    width, new = max(lens), 3
    prompts = [_tokens(cfg, (n,), seed=10 + i) for i, n in enumerate(lens)]
    cont = _tokens(cfg, (len(lens), new), seed=20)
    batch = np.zeros((len(lens), width), np.int32) + 7  # right padding with an arbitrary id
    for i, pr in enumerate(prompts):
        batch[i, :len(pr)] = pr

    cache = KVCache.create(cfg, len(lens), 16)
    pre = forward(cfg, w, jnp.asarray(batch), _positions(jnp.zeros(3), width), cache)
    cache = pre.cache.with_lengths(jnp.asarray(lens))
    step = forward(cfg, w, jnp.asarray(cont), _positions(jnp.asarray(lens), new), cache)

    for i, pr in enumerate(prompts):
        single = _full(model, np.concatenate([pr, cont[i]])[None], capacity=16).logits[0]
        np.testing.assert_allclose(pre.logits[i, :lens[i]], single[:lens[i]], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(step.logits[i], single[lens[i]:], rtol=RTOL, atol=ATOL)


def test_tree_ancestors_hand_written():
    #      0        4
    #     / \       |
    #    1   2      5
    #    |
    #    3
    parents = jnp.array([-1, 0, 0, 1, -1, 4], jnp.int32)
    expected = np.zeros((6, 6), bool)
    for node, anc in {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [4], 5: [4, 5]}.items():
        expected[node, anc] = True
    np.testing.assert_array_equal(np.asarray(tree_ancestors(parents)), expected)
    # batched parents, including a deep chain (needs repeated squaring)
    chain = jnp.arange(-1, 9, dtype=jnp.int32)
    got = np.asarray(tree_ancestors(jnp.stack([chain, jnp.full((10,), -1, jnp.int32)])))
    np.testing.assert_array_equal(got[0], np.tril(np.ones((10, 10), bool)))
    np.testing.assert_array_equal(got[1], np.eye(10, dtype=bool))


def _depths(parents) -> list[int]:
    d = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def _path(parents, node) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("name", ["llama_tied_gqa2", "qwen3_qknorm"])
def test_tree_forward_matches_chain_per_path(name):
    model = _model(name)
    cfg, w = model.config, model.weights
    p = 5
    prefix = jnp.asarray(_tokens(cfg, (1, p), seed=30))
    parents = [-1, 0, 0, 1, 2, 2, 4, -1, 7]
    tree_tokens = jnp.asarray(_tokens(cfg, (1, len(parents)), seed=31))
    pre = forward(cfg, w, prefix, _positions(0, p), KVCache.create(cfg, 1, 24))
    cache = pre.cache.with_lengths(jnp.array([p]))
    pos = jnp.asarray(p + np.array(_depths(parents)), jnp.int32)[None]
    out = forward(cfg, w, tree_tokens, pos, cache, mask=Tree(jnp.asarray(parents, jnp.int32)))
    for node in range(len(parents)):
        path = _path(parents, node)
        chain = forward(cfg, w, tree_tokens[:, path], _positions(p, len(path)), cache, mask=Chain())
        np.testing.assert_allclose(out.logits[0, node], chain.logits[0, -1], rtol=RTOL, atol=ATOL)


def test_tree_forward_batched_parents():
    model = _model("llama_tied_gqa2")
    cfg, w = model.config, model.weights
    parents = np.array([[-1, 0, 1, 1], [-1, -1, 0, 1]], np.int32)
    lens = np.array([4, 2])
    prompt = jnp.asarray(_tokens(cfg, (2, 4), seed=40))
    new = jnp.asarray(_tokens(cfg, (2, 4), seed=41))
    pre = forward(cfg, w, prompt, _positions(jnp.zeros(2), 4), KVCache.create(cfg, 2, 16))
    cache = pre.cache.with_lengths(jnp.asarray(lens))
    pos = jnp.asarray(lens[:, None] + np.array([_depths(r) for r in parents]), jnp.int32)
    out = forward(cfg, w, new, pos, cache, mask=Tree(jnp.asarray(parents)))
    for b in range(2):
        for node in range(4):
            path = _path(parents[b], node)
            toks = np.concatenate([np.asarray(prompt[b, :lens[b]]), np.asarray(new[b, path])])
            ref = _full(model, toks[None], capacity=16).logits[0, -1]
            np.testing.assert_allclose(out.logits[b, node], ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["llama_untied_mha", "qwen2_bias"])
def test_hidden_layers_and_early_exit(name):
    model = _model(name)
    cfg, w = model.config, model.weights
    n_l = cfg.num_layers
    tokens = _tokens(cfg, (2, 7), seed=50)
    out = _full(model, tokens, hidden_layers=tuple(range(n_l + 1)))
    assert out.hidden.shape == (n_l + 1, 2, 7, cfg.hidden_size)
    np.testing.assert_array_equal(out.hidden[0], np.asarray(w.embed)[tokens])
    _, ref_h = ref_forward(cfg, w, tokens[1])
    np.testing.assert_allclose(out.hidden[:, 1], ref_h, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out.final_hidden, rms_norm(out.hidden[-1], w.final_norm, cfg.rms_eps),
                               rtol=1e-6, atol=1e-6)
    # a subset, in any order and with duplicates, comes back sorted and unique
    sub = _full(model, tokens, hidden_layers=(n_l, 1, 1))
    np.testing.assert_allclose(sub.hidden, out.hidden[jnp.array([1, n_l])], rtol=1e-6, atol=1e-6)
    assert _full(model, tokens).hidden is None
    with pytest.raises(ValueError, match="hidden layer"):
        _full(model, tokens, hidden_layers=(n_l + 1,))
    assert _full(model, tokens, compute_logits=False).logits is None

    # early exit after N layers == a model that only has the first N layers
    n = 1
    short_cfg = cfg.replace(num_layers=n)
    short_w = Weights(embed=w.embed, layers=jax.tree.map(lambda a: a[:n], w.layers),
                      final_norm=w.final_norm, lm_head=w.lm_head)
    want = forward(short_cfg, short_w, jnp.asarray(tokens), _positions(jnp.zeros(2), 7),
                   KVCache.create(short_cfg, 2, 16), hidden_layers=(n,))
    for cache in (KVCache.create(cfg, 2, 16, num_layers=n), KVCache.create(cfg, 2, 16)):
        got = forward(cfg, w, jnp.asarray(tokens), _positions(jnp.zeros(2), 7), cache,
                      num_layers=n, hidden_layers=(n,))
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got.hidden, want.hidden, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got.hidden[0], out.hidden[n], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["llama_untied_mha", "qwen2_bias", "qwen3_qknorm"])
def test_bfloat16_model(name):
    model = _model(name)
    bf = model.astype("bfloat16")
    assert bf.config.dtype == "bfloat16" and model.config.dtype == "float32"
    lw = bf.weights.layers
    for a in (lw.attn_norm, lw.mlp_norm, bf.weights.final_norm):
        assert a.dtype == jnp.float32
    if bf.config.qk_norm:
        assert lw.q_norm.dtype == jnp.float32 and lw.k_norm.dtype == jnp.float32
    for a in (lw.wq, lw.wo, lw.w_down, bf.weights.embed):
        assert a.dtype == jnp.bfloat16
    if bf.config.qkv_bias:
        assert lw.bq.dtype == jnp.bfloat16
    tokens = _tokens(model.config, (2, 8), seed=60)
    ref = np.asarray(_full(model, tokens).logits)
    out = _full(bf, tokens)
    assert out.logits.dtype == jnp.float32
    assert out.cache.k.dtype == jnp.bfloat16
    got = np.asarray(out.logits)
    assert np.all(np.isfinite(got))
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() < 0.05 * scale
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) > 0.8


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_heads=6, num_kv_heads=4), "multiple of num_kv_heads"),
    (dict(arch="gpt2"), "unsupported architecture"),
    (dict(arch="mistral"), "unsupported architecture"),
    (dict(rope_scaling=(("factor", 4.0), ("rope_type", "yarn"))), "unsupported rope_scaling"),
    (dict(rope_scaling=(("factor", 4.0), ("type", "dynamic"))), "unsupported rope_scaling"),
    (dict(head_dim=7), "even"),
    (dict(num_layers=0), "num_layers"),
    (dict(vocab_size=-1), "vocab_size"),
    (dict(dtype="float16"), "dtype"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(jspec.JspecError, match=match):
        ModelConfig(**kwargs)
    with pytest.raises(ValueError):  # JspecError is a ValueError
        ModelConfig().replace(**kwargs)


def test_config_accepts_supported_rope_scaling_and_is_hashable():
    for kind in ("default", "linear", "llama3"):
        cfg = ModelConfig(rope_scaling=(("factor", 2.0), ("rope_type", kind)))
        hash(cfg)
    lin = ModelConfig(rope_scaling=(("factor", 2.0), ("type", "linear")))
    np.testing.assert_allclose(lin.inv_freq(), ModelConfig().inv_freq() / 2.0, rtol=1e-6)
    np.testing.assert_allclose(lin.inv_freq(), ref_inv_freq(lin), rtol=1e-6)


def test_eval_shape_smollm2_135m():
    cfg = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, ffn_size=1536, rope_theta=100000.0,
                      max_position=8192)
    weights = jax.eval_shape(functools.partial(init_weights, cfg), jax.random.key(0))
    assert weights.layers.wq.shape == (30, 576, 576)
    assert weights.layers.wk.shape == (30, 576, 192)
    assert weights.layers.w_down.shape == (30, 1536, 576)
    assert weights.embed.shape == (49152, 576) and weights.lm_head is None
    n_params = sum(math.prod(a.shape) for a in jax.tree.leaves(weights))
    assert 134e6 < n_params < 135e6
    b, t, s = 2, 16, 256
    cache = jax.eval_shape(lambda: KVCache.create(cfg, b, s))
    tokens = jax.ShapeDtypeStruct((b, t), jnp.int32)
    positions = jax.ShapeDtypeStruct((b, t), jnp.int32)
    out = jax.eval_shape(lambda w, x, p, c: forward(cfg, w, x, p, c, hidden_layers=(0, 15, 30)),
                         weights, tokens, positions, cache)
    assert out.logits.shape == (b, t, 49152) and out.logits.dtype == jnp.float32
    assert out.cache.k.shape == (30, b, s, 3, 64) and out.cache.lengths.shape == (b,)
    assert out.hidden.shape == (3, b, t, 576)
    assert out.final_hidden.shape == (b, t, 576)
