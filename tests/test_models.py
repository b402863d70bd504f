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
from jspec.models.blocks import rms_norm
from jspec.models.cache import from_storage
from jspec.models.llama import Weights, tree_ancestors
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
    lw = jax.tree.map(lambda *a: np.stack(a), *w.layers)  # [L, ...] stacked for indexing
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
# Helpers. Shapes are shared between tests (B=2, S=16, T in {10, 4, 1}) so that the jitted
# forward compiles few times; XLA's backend optimisation is off, which halves compile time.
# --------------------------------------------------------------------------------------------

B, S, N = 2, 16, 10


@functools.partial(jax.jit, static_argnums=0,
                   static_argnames=("hidden_layers", "compute_logits", "num_layers"),
                   compiler_options={"xla_backend_optimization_level": 0})
def fwd(cfg, weights, tokens, positions, cache, parents=None, hidden_layers=(), compute_logits=True,
        num_layers=None):
    mask = Chain() if parents is None else Tree(parents)
    return forward(cfg, weights, tokens, positions, cache, mask=mask, hidden_layers=hidden_layers,
                   compute_logits=compute_logits, num_layers=num_layers)


def random_model(name: str, seed: int = 1) -> Model:
    return tiny_model(name, seed)


@functools.cache
def _model(name: str) -> Model:
    return random_model(name)


def _tokens(cfg: ModelConfig, shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=shape).astype(np.int32)


def _pos(start, t: int) -> np.ndarray:
    """i32[B, t]: positions start[b] + 0..t-1 (numpy: no eager jax ops to compile)."""
    start = np.asarray(start, np.int32).reshape(-1)
    return start[:, None] + np.arange(t, dtype=np.int32)[None, :]


def _full(model: Model, tokens, start=(0, 0), **kw):
    """Forward over whole rows from an empty cache."""
    tokens = jnp.asarray(tokens)
    b, t = tokens.shape
    return fwd(model.config, model.weights, tokens, _pos(start, t),
               KVCache.create(model.config, b, S), **kw)


def _close(actual, desired, tol=RTOL):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(desired), rtol=tol, atol=tol)


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
    tokens = _tokens(cfg, (B, N), seed=3)
    starts = (0, 40)  # row 1 sits at later positions (RoPE / rope scaling at an offset)
    out = _full(model, tokens, start=starts)
    assert out.logits.shape == (B, N, cfg.vocab_size) and out.logits.dtype == jnp.float32
    assert out.final_hidden.shape == (B, N, cfg.hidden_size)
    for b in range(B):
        ref, _ = ref_forward(cfg, model.weights, tokens[b], starts[b] + np.arange(N))
        _close(out.logits[b], ref)
    # the new K/V land in slots 0..N-1; forward never advances the lengths
    assert np.all(np.asarray(out.cache.lengths) == 0)
    assert np.any(np.stack(out.cache.k)[:, :, :, N - 1] != 0)  # [L, B, KV, S, hd]
    assert np.all(np.stack(out.cache.k)[:, :, :, N:] == 0)


@pytest.mark.parametrize("name", ["llama_tied_gqa2", "llama_mqa_scaled", "qwen3_qknorm"])
def test_incremental_decode_equals_full_forward(name):
    model = _model(name)
    cfg, w = model.config, model.weights
    tokens = jnp.asarray(_tokens(cfg, (B, N), seed=5))
    full = _full(model, tokens).logits

    # prefill 4 tokens
    out = fwd(cfg, w, tokens[:, :4], _pos([0, 0], 4), KVCache.create(cfg, B, S))
    _close(out.logits, full[:, :4])
    cache = out.cache.with_lengths(out.cache.lengths + 4)
    # rejected drafts: K/V written at slots 4..7 but lengths not advanced; later steps must
    # ignore (or overwrite) that scratch
    junk = jnp.asarray(_tokens(cfg, (B, 4), seed=6))
    cache = fwd(cfg, w, junk, _pos(cache.lengths, 4), cache).cache
    assert np.all(np.asarray(cache.lengths) == 4)
    # one token at a time
    for i in (4, 5):
        out = fwd(cfg, w, tokens[:, i:i + 1], _pos(cache.lengths, 1), cache)
        _close(out.logits[:, 0], full[:, i])
        cache = out.cache.with_lengths(cache.lengths + 1)
    # then a multi-token chunk
    out = fwd(cfg, w, tokens[:, 6:], _pos(cache.lengths, 4), cache)
    _close(out.logits, full[:, 6:])


@pytest.mark.parametrize("name", ["llama_mqa_scaled", "qwen3_qknorm"])
def test_batch_right_padding_and_ragged_lengths_match_single_rows(name):
    model = _model(name)
    cfg, w = model.config, model.weights
    lens = np.array([4, 2])
    prompts = [_tokens(cfg, (n,), seed=10 + i) for i, n in enumerate(lens)]
    cont = _tokens(cfg, (B, 4), seed=20)
    batch = np.full((B, 4), 7, np.int32)  # right padding with an arbitrary id
    for i, pr in enumerate(prompts):
        batch[i, :len(pr)] = pr

    pre = fwd(cfg, w, jnp.asarray(batch), _pos([0, 0], 4), KVCache.create(cfg, B, S))
    cache = pre.cache.with_lengths(jnp.asarray(lens))
    step = fwd(cfg, w, jnp.asarray(cont), _pos(lens, 4), cache)

    for i, pr in enumerate(prompts):
        alone, _ = ref_forward(cfg, w, np.concatenate([pr, cont[i]]))
        _close(pre.logits[i, :lens[i]], alone[:lens[i]])
        _close(step.logits[i], alone[lens[i]:])


def test_tree_ancestors_hand_written():
    ancestors = jax.jit(tree_ancestors, compiler_options={"xla_backend_optimization_level": 0})
    #      0        4
    #     / \       |
    #    1   2      5
    #    |
    #    3
    parents = np.array([-1, 0, 0, 1, -1, 4], np.int32)
    expected = np.zeros((6, 6), bool)
    for node, anc in {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [4], 5: [4, 5]}.items():
        expected[node, anc] = True
    np.testing.assert_array_equal(np.asarray(ancestors(parents)), expected)
    # batched parents: a deep chain (needs repeated squaring) and all roots
    chain = np.arange(-1, 9, dtype=np.int32)
    got = np.asarray(ancestors(np.stack([chain, np.full((10,), -1, np.int32)])))
    np.testing.assert_array_equal(got[0], np.tril(np.ones((10, 10), bool)))
    np.testing.assert_array_equal(got[1], np.eye(10, dtype=bool))


def _depths(parents) -> list[int]:
    d: list[int] = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def _path(parents, node) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("name", ["llama_tied_gqa2"])
def test_tree_forward_matches_chain_per_path(name):
    model = _model(name)
    cfg, w = model.config, model.weights
    lens = np.array([4, 2])
    parents = np.array([[-1, 0, 0, 1, 2, 2, 4, -1, 7],
                        [-1, -1, 0, 1, 1, 3, 5, 6, 2]], np.int32)
    t = parents.shape[1]
    pre = fwd(cfg, w, jnp.asarray(_tokens(cfg, (B, 4), seed=30)), _pos([0, 0], 4),
              KVCache.create(cfg, B, S))
    cache = pre.cache.with_lengths(jnp.asarray(lens))
    new = _tokens(cfg, (B, t), seed=31)
    pos = jnp.asarray(lens[:, None] + np.array([_depths(r) for r in parents]), jnp.int32)
    out = fwd(cfg, w, jnp.asarray(new), pos, cache, parents=jnp.asarray(parents))
    assert np.all(np.asarray(out.cache.lengths) == lens)

    # Every (row, node) as its own chain row: the root-to-node path over the row's prefix,
    # right-padded; causality makes the padding irrelevant to the path's last logit.
    items = [(b, node, _path(parents[b], node)) for b in range(B) for node in range(t)]
    width = max(len(p) for _, _, p in items)
    rows = np.array([b for b, _, _ in items])
    chain_tokens = np.zeros((len(items), width), np.int32)
    for k, (b, _, path) in enumerate(items):
        chain_tokens[k, :len(path)] = new[b, path]
    chain_cache = jax.tree.map(lambda a: a[:, rows] if a.ndim == 5 else a[rows], cache)
    chain = fwd(cfg, w, jnp.asarray(chain_tokens), _pos(lens[rows], width), chain_cache)
    for k, (b, node, path) in enumerate(items):
        _close(out.logits[b, node], chain.logits[k, len(path) - 1])


@pytest.mark.parametrize("name", ["llama_untied_mha"])
def test_hidden_layers_and_early_exit(name):
    model = _model(name)
    cfg, w = model.config, model.weights
    n_l = cfg.num_layers
    tokens = _tokens(cfg, (B, N), seed=50)
    out = _full(model, tokens, hidden_layers=tuple(range(n_l + 1)))
    assert out.hidden.shape == (n_l + 1, B, N, cfg.hidden_size)
    np.testing.assert_array_equal(out.hidden[0], np.asarray(w.embed)[tokens])
    ref_logits, ref_h = ref_forward(cfg, w, tokens[1])
    _close(out.hidden[:, 1], ref_h)
    _close(out.logits[1], ref_logits)
    _close(out.final_hidden, rms_norm(out.hidden[-1], w.final_norm, cfg.rms_eps), 1e-6)

    # shapes only (no compile): a subset comes back sorted and deduplicated; no logits on request
    def shape_of(**kw):
        return jax.eval_shape(lambda x, c: forward(cfg, w, x, _pos([0, 0], N), c, **kw),
                              jnp.asarray(tokens), KVCache.create(cfg, B, S))
    assert shape_of(hidden_layers=(n_l, 0, 0)).hidden.shape == (2, B, N, cfg.hidden_size)
    assert shape_of().hidden is None
    assert shape_of(compute_logits=False).logits is None
    with pytest.raises(ValueError, match="hidden layer"):
        shape_of(hidden_layers=(n_l + 1,))
    with pytest.raises(ValueError, match="hidden layer"):
        shape_of(num_layers=1, hidden_layers=(2,))

    # early exit after n layers == a model that only has the first n layers
    n = n_l - 1
    short_cfg = cfg.replace(num_layers=n)
    short_w = Weights(embed=w.embed, layers=w.layers[:n],
                      final_norm=w.final_norm, lm_head=w.lm_head)
    got = fwd(cfg, w, jnp.asarray(tokens), _pos([0, 0], N), KVCache.create(cfg, B, S, num_layers=n),
              num_layers=n, hidden_layers=(n,))
    assert len(got.cache.k) == n
    _close(got.hidden[0], out.hidden[n], 1e-6)
    for b in range(B):
        ref, _ = ref_forward(short_cfg, short_w, tokens[b])
        _close(got.logits[b], ref)


@pytest.mark.parametrize("name", ["qwen2_bias", "qwen3_qknorm"])
def test_bfloat16_model(name):
    model = _model(name)
    bf = model.astype("bfloat16")
    assert bf.config.dtype == "bfloat16" and model.config.dtype == "float32"
    lw = bf.weights.layers[0]
    for a in (lw.attn_norm, lw.mlp_norm, bf.weights.final_norm):
        assert a.dtype == jnp.float32
    if bf.config.qk_norm:
        assert lw.q_norm.dtype == jnp.float32 and lw.k_norm.dtype == jnp.float32
    for a in (lw.wq, lw.wk, lw.wv, lw.wo, lw.w_gate, lw.w_up, lw.w_down, bf.weights.embed):
        assert a.dtype == jnp.bfloat16
    if bf.config.qkv_bias:
        assert lw.bq.dtype == jnp.bfloat16
    if not bf.config.tie_embeddings:
        assert bf.weights.lm_head.dtype == jnp.bfloat16
    tokens = _tokens(model.config, (B, N), seed=3)
    ref = np.asarray(_full(model, tokens).logits)
    out = _full(bf, tokens)
    assert out.logits.dtype == jnp.float32
    # A 16-bit cache is stored as its uint16 bits (jspec.models.cache.storage_dtype).
    assert out.cache.k[0].dtype == jnp.uint16
    assert from_storage(out.cache.k[0], jnp.bfloat16).dtype == jnp.bfloat16
    got = np.asarray(out.logits)
    assert np.all(np.isfinite(got))
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.8
    # and back to float32 recovers the original logits closely (weights went through bf16)
    back = model.astype("float32")
    _close(_full(back, tokens).logits, ref, 1e-5)


def test_bfloat16_one_row_matmul_is_padded_on_cpu_and_unchanged(monkeypatch):
    """XLA:CPU's one-row bfloat16 matmul is slow, so `matmul` computes it as two rows (the
    second zero) on CPU where the small-M kernel is off (a `cpu-bf16` machine; forced off here).
    The padded product equals the plain einsum, and a bfloat16 decode of one token at a time
    (the padded path) agrees with the multi-token forward."""
    from jspec.models import cpu_gemm
    from jspec.models.blocks import matmul

    monkeypatch.setenv(cpu_gemm.ENV, "0")

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 1, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 96)), jnp.bfloat16)
    got = jax.jit(lambda x, w: matmul("...d,df->...f", x, w))(x, w)
    want = jnp.einsum("...d,df->...f", x.astype(jnp.float32), w.astype(jnp.float32))
    assert got.shape == (1, 1, 96) and got.dtype == jnp.float32
    _close(got, want, 1e-4)
    jaxpr = str(jax.make_jaxpr(lambda x, w: matmul("...d,df->...f", x, w))(x, w))
    if jax.default_backend() == "cpu":
        assert "bf16[2,64]" in jaxpr  # the padded operand
    # two rows or float32: the plain einsum, no padding
    assert "bf16[2,64]" not in str(jax.make_jaxpr(
        lambda x, w: matmul("...d,df->...f", x, w))(jnp.concatenate([x, x], 1), w))
    assert "[2,64]" not in str(jax.make_jaxpr(
        lambda x, w: matmul("...d,df->...f", x, w))(x.astype(jnp.float32), w.astype(jnp.float32)))

    bf = _model("llama_tied_gqa2").astype("bfloat16")
    tokens = _tokens(bf.config, (1, 6), seed=5)
    full = np.asarray(_full(bf, tokens, start=(0,)).logits)[0]
    cache = KVCache.create(bf.config, 1, S)
    steps = []
    for t in range(6):
        out = fwd(bf.config, bf.weights, jnp.asarray(tokens[:, t:t + 1]), _pos((t,), 1), cache)
        cache = out.cache.with_lengths(out.cache.lengths + 1)
        steps.append(np.asarray(out.logits)[0, 0])
    steps = np.stack(steps)
    assert np.abs(steps - full).max() < 0.02 * np.abs(full).max()
    assert np.array_equal(steps.argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_heads=6, num_kv_heads=4), "multiple of num_kv_heads"),
    (dict(arch="gpt2"), "unsupported architecture"),
    (dict(arch="mistral"), "unsupported architecture"),
    (dict(rope_scaling=(("factor", 4.0), ("rope_type", "yarn"))), "unsupported rope_scaling"),
    (dict(rope_scaling=(("factor", 4.0), ("type", "dynamic"))), "unsupported rope_scaling"),
    (dict(head_dim=7), "even"),
    (dict(num_layers=0), "num_layers"),
    (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(vocab_size=-1), "vocab_size"),
    (dict(dtype="float16"), "dtype"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(jspec.JspecError, match=match):
        ModelConfig(**kwargs)
    with pytest.raises(ValueError, match=match):  # JspecError is a ValueError; replace validates
        ModelConfig().replace(**kwargs)


def test_config_accepts_supported_rope_scaling_and_is_hashable():
    for kind in ("default", "linear", "llama3"):
        cfg = ModelConfig(rope_scaling=(("factor", 2.0), ("rope_type", kind)))
        assert hash(cfg) == hash(ModelConfig(rope_scaling=(("factor", 2.0), ("rope_type", kind))))
    lin = ModelConfig(rope_scaling=(("factor", 2.0), ("type", "linear")))
    np.testing.assert_allclose(lin.inv_freq(), ModelConfig().inv_freq() / 2.0, rtol=1e-6)
    np.testing.assert_allclose(lin.inv_freq(), ref_inv_freq(lin), rtol=1e-6)


def test_eval_shape_smollm2_135m():
    cfg = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, ffn_size=1536, rope_theta=100000.0,
                      max_position=8192)
    weights = jax.eval_shape(functools.partial(init_weights, cfg), jax.random.key(0))
    assert len(weights.layers) == 30
    assert weights.layers[0].wq.shape == (576, 576)
    assert weights.layers[0].wk.shape == (576, 192)
    assert weights.layers[29].w_down.shape == (1536, 576)
    assert weights.embed.shape == (49152, 576) and weights.lm_head is None
    n_params = sum(math.prod(a.shape) for a in jax.tree.leaves(weights))
    assert 134e6 < n_params < 135e6  # SmolLM2-135M
    b, t, s = 2, 16, 256
    cache = jax.eval_shape(lambda: KVCache.create(cfg, b, s))
    tokens = jax.ShapeDtypeStruct((b, t), jnp.int32)
    positions = jax.ShapeDtypeStruct((b, t), jnp.int32)
    out = jax.eval_shape(lambda w, x, p, c: forward(cfg, w, x, p, c, hidden_layers=(0, 15, 30)),
                         weights, tokens, positions, cache)
    assert out.logits.shape == (b, t, 49152) and out.logits.dtype == jnp.float32
    assert len(out.cache.k) == 30 and out.cache.k[0].shape == (b, 3, s, 64)
    assert out.cache.lengths.shape == (b,)
    assert out.hidden.shape == (3, b, t, 576)
    assert out.final_hidden.shape == (b, t, 576)
    # a tree verify block at the same size
    parents = jnp.array([-1, 0, 0, 1, 1, 2, 2, 3], jnp.int32)
    tree = jax.eval_shape(lambda w, c: forward(cfg, w, jnp.zeros((b, 8), jnp.int32),
                                               jnp.zeros((b, 8), jnp.int32), c, mask=Tree(parents)),
                          weights, cache)
    assert tree.logits.shape == (b, 8, 49152)


