"""pallas_kernels.tree_attention: the kernel (interpret mode on CPU) against its jnp reference, and
the reference against a brute-force NumPy attention. Cache slots beyond each row's length are NaN,
so any read of them fails the comparison."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tree_attention import pick_block_kv, tree_attention, tree_attention_reference

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}

TREES = {
    "chain": None,
    "star": lambda t: [-1] + [0] * (t - 1),
    "binary": lambda t: [-1] + [(i - 1) // 2 for i in range(1, t)],
    "two_roots": lambda t: [-1, -1] + [i - 2 for i in range(2, t)],
}


def _parents(kind, t, b, rng):
    if kind == "random_per_row":  # a different random tree in every row
        return np.stack([[-1] + [int(rng.integers(-1, i)) for i in range(1, t)] for _ in range(b)])
    f = TREES[kind]
    return None if f is None else np.asarray(f(t), np.int32)


def _inputs(b, t, h, kv, hd, s, dtype, lengths, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, hd))
    kc = rng.standard_normal((b, s, kv, hd))
    vc = rng.standard_normal((b, s, kv, hd))
    for i, n in enumerate(lengths):  # junk beyond each row's length: NaN
        kc[i, n:] = np.nan
        vc[i, n:] = np.nan
    kn = rng.standard_normal((b, t, kv, hd))
    vn = rng.standard_normal((b, t, kv, hd))
    kc, vc = kc.swapaxes(1, 2), vc.swapaxes(1, 2)  # the cache layout [B, KV, S, hd]
    return [jnp.asarray(a, dtype) for a in (q, kc, vc)] + [jnp.asarray(lengths, jnp.int32)] + \
        [jnp.asarray(a, dtype) for a in (kn, vn)]


def _brute_force(q, kc, vc, lengths, kn, vn, parents):
    """Per node, per head: softmax over the visible keys, in float64."""
    q, kc, vc, kn, vn = (np.asarray(a, np.float64) for a in (q, kc, vc, kn, vn))
    kc, vc = kc.swapaxes(1, 2), vc.swapaxes(1, 2)  # [B, S, KV, hd] below
    b, t, h, hd = q.shape
    kv = kc.shape[2]
    par = np.broadcast_to(np.arange(t) - 1 if parents is None else np.asarray(parents), (b, t))
    out = np.zeros(q.shape)
    for i, u, hh in itertools.product(range(b), range(t), range(h)):
        k = hh // (h // kv)
        nodes, a = [], u
        while a >= 0:
            nodes.append(a)
            a = par[i, a]
        keys = np.concatenate([kc[i, : lengths[i], k], kn[i, nodes, k]])
        vals = np.concatenate([vc[i, : lengths[i], k], vn[i, nodes, k]])
        sc = keys @ q[i, u, hh] / np.sqrt(hd)
        w = np.exp(sc - sc.max())
        out[i, u, hh] = w @ vals / w.sum()
    return out


@pytest.mark.parametrize("tree", ["chain", "star", "binary", "two_roots", "random_per_row"])
def test_reference_matches_brute_force(tree):
    b, t, h, kv, hd, s = 3, 6, 4, 2, 8, 16
    lengths = [0, 5, 16]
    args = _inputs(b, t, h, kv, hd, s, jnp.float32, lengths)
    par = _parents(tree, t, b, np.random.default_rng(1))
    ref = tree_attention_reference(*args, None if par is None else jnp.asarray(par))
    want = _brute_force(*args[:3], lengths, *args[4:], par)
    np.testing.assert_allclose(np.asarray(ref), want, atol=1e-5, rtol=1e-5)


# (B, T, H, KV, hd, S, block_kv, lengths): GQA groups 1/2/4/8, partial / empty / full prefixes,
# one and several tiles, a single node.
SHAPES = [
    (2, 4, 4, 2, 8, 16, 8, [0, 11]),
    (3, 5, 8, 2, 16, 32, 8, [7, 32, 1]),
    (1, 1, 4, 4, 8, 24, 8, [13]),
    (2, 8, 8, 1, 16, 16, 16, [3, 16]),
    (1, 16, 2, 1, 8, 64, 32, [40]),
]


def _shape_id(s):
    return "B{}T{}H{}KV{}hd{}S{}bk{}".format(*s[:7])


# Default run: each shape in one dtype (alternating); the slow run: every shape in both.
_SHAPE_DTYPES = [pytest.param(shape, dtype, id=f"{_shape_id(shape)}-{name}",
                              marks=() if (i + j) % 2 == 0 else pytest.mark.slow)
                 for i, shape in enumerate(SHAPES)
                 for j, (dtype, name) in enumerate(((jnp.float32, "f32"), (jnp.bfloat16, "bf16")))]


@pytest.mark.parametrize("shape,dtype", _SHAPE_DTYPES)
def test_kernel_matches_reference(shape, dtype):
    b, t, h, kv, hd, s, bk, lengths = shape
    tree = ["chain", "binary", "random_per_row"][(b + t) % 3]
    args = _inputs(b, t, h, kv, hd, s, dtype, lengths, seed=t)
    par = _parents(tree, t, b, np.random.default_rng(t))
    par = None if par is None else jnp.asarray(par)
    out = tree_attention(*args, par, block_kv=bk)
    ref = tree_attention_reference(*args, par)
    assert out.dtype == dtype and out.shape == (b, t, h, hd)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("tree", ["star", "two_roots"])  # chain/binary/random: in the test above
def test_kernel_tree_shapes(tree):
    b, t, h, kv, hd, s = 2, 7, 4, 2, 8, 16
    args = _inputs(b, t, h, kv, hd, s, jnp.float32, [9, 0], seed=3)
    par = _parents(tree, t, b, None)
    par = None if par is None else jnp.asarray(par)
    np.testing.assert_allclose(np.asarray(tree_attention(*args, par, block_kv=8)),
                               np.asarray(tree_attention_reference(*args, par)), atol=2e-5)


def test_kernel_with_tpu_interpret_semantics():
    """TPU interpret mode: NaN-initialised scratch and out-of-bounds checks (slow: one tiny case)."""
    args = _inputs(2, 3, 4, 2, 8, 16, jnp.float32, [0, 10], seed=5)
    par = jnp.asarray([-1, 0, 0])
    out = tree_attention(*args, par, block_kv=8, interpret=pltpu.InterpretParams())
    np.testing.assert_allclose(np.asarray(out), np.asarray(tree_attention_reference(*args, par)),
                               atol=2e-5)


def test_kernel_differs_when_a_visible_key_changes():
    """The comparison can fail: perturbing one committed key changes the output."""
    args = _inputs(1, 3, 2, 1, 8, 16, jnp.float32, [6], seed=2)
    base = np.asarray(tree_attention(*args, block_kv=8))
    args[1] = args[1].at[0, :, 5].add(3.0)  # the last committed slot ([B, KV, S, hd])
    assert np.abs(np.asarray(tree_attention(*args, block_kv=8)) - base).max() > 1e-3


def test_input_validation():
    args = _inputs(2, 3, 4, 2, 8, 16, jnp.float32, [1, 2])
    with pytest.raises(ValueError, match="block_kv"):
        tree_attention(*args, block_kv=5)
    with pytest.raises(ValueError, match="parents"):
        tree_attention(*args, jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="multiple"):
        tree_attention(args[0][:, :, :3], *args[1:])
    with pytest.raises(ValueError, match="lengths"):
        tree_attention(*args[:3], args[3][:1], *args[4:])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        tree_attention(args[0].astype(jnp.float16), *args[1:])


def test_pick_block_kv_divides_capacity():
    for s in (16, 24, 100, 128, 4096, 97):
        for dt in (jnp.float32, jnp.bfloat16):
            bk = pick_block_kv(s, dt)
            assert s % bk == 0 and 1 <= bk <= 1024
    assert pick_block_kv(4096, jnp.bfloat16, "TPU v6e") == 1024


def test_no_recompile_on_second_call():
    args = _inputs(1, 2, 2, 1, 8, 16, jnp.float32, [4])
    tree_attention(*args, block_kv=8)
    with jax.log_compiles():
        before = tree_attention._cache_size()
        tree_attention(*[a + 0 if a.dtype != jnp.int32 else a + 1 for a in args], block_kv=8)
        assert tree_attention._cache_size() == before


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tree", [*TREES, "random_per_row"])
@pytest.mark.parametrize("b,t,h,kv,hd,s,bk", [(2, 16, 8, 2, 32, 128, 32), (4, 32, 4, 4, 16, 64, 16),
                                              (1, 64, 4, 1, 64, 256, 128)])
def test_kernel_sweep_slow(b, t, h, kv, hd, s, bk, tree, dtype):
    rng = np.random.default_rng(b * t)
    lengths = [int(x) for x in rng.integers(0, s + 1, size=b)]
    args = _inputs(b, t, h, kv, hd, s, dtype, lengths, seed=s)
    par = _parents(tree, t, b, rng)
    par = None if par is None else jnp.asarray(par)
    np.testing.assert_allclose(np.asarray(tree_attention(*args, par, block_kv=bk), np.float32),
                               np.asarray(tree_attention_reference(*args, par), np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])


# --------------------------------------------------------------------------------------------
# Wired into the model: forward(config.attention_impl="pallas") vs "xla"
# --------------------------------------------------------------------------------------------

def _prefilled(model, lengths, capacity=32, seed=0):
    """A cache holding random prompts of the given lengths (through the XLA path)."""
    from jspec.models import KVCache, forward

    cfg = model.config.replace(attention_impl="xla")
    b, p = len(lengths), max(lengths)
    ids = jnp.asarray(np.random.default_rng(seed).integers(2, cfg.vocab_size, (b, p)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    out = forward(cfg, model.weights, ids, pos, KVCache.create(cfg, b, capacity))
    return out.cache.with_lengths(jnp.asarray(lengths, jnp.int32))


@pytest.mark.parametrize("mask_kind", ["chain", "tree_shared", "tree_per_row"])
def test_verification_forward_pallas_equals_xla(mask_kind):
    from conftest import tiny_model

    from jspec.models import Chain, Tree, forward

    model = tiny_model("llama_tied_gqa2", seed=3)
    cache = _prefilled(model, [5, 1, 9])
    t = 5
    toks = jnp.asarray(np.random.default_rng(1).integers(2, 97, (3, t)), jnp.int32)
    pos = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    if mask_kind == "chain":
        mask = Chain()
    elif mask_kind == "tree_shared":
        mask = Tree(jnp.asarray([-1, 0, 0, 1, 2], jnp.int32))
    else:
        mask = Tree(jnp.asarray([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3], [-1, -1, 0, 1, 0]], jnp.int32))
        pos = cache.lengths[:, None] + jnp.asarray([[0, 1, 1, 2, 2], [0, 1, 2, 3, 4], [0, 0, 1, 2, 1]])
    parents = mask.parents if isinstance(mask, Tree) else None

    @functools.partial(jax.jit, static_argnums=0)
    def fwd(cfg, weights, toks, pos, cache, parents):
        m = Chain() if parents is None else Tree(parents)
        return forward(cfg, weights, toks, pos, cache, m, hidden_layers=(1, 2))

    outs = {impl: fwd(model.config.replace(attention_impl=impl), model.weights, toks, pos, cache,
                      parents) for impl in ("xla", "pallas")}
    np.testing.assert_allclose(np.asarray(outs["pallas"].logits), np.asarray(outs["xla"].logits),
                               atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(outs["pallas"].hidden), np.asarray(outs["xla"].hidden),
                               atol=1e-4, rtol=1e-4)
    # Layer 1 writes identical K/V; later layers' inputs differ by float rounding only.
    for a, b in zip(outs["pallas"].cache.k, outs["xla"].cache.k, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_pallas_forward_ignores_junk_beyond_the_committed_prefix():
    from conftest import tiny_model

    from jspec.models import Chain, forward

    model = tiny_model("qwen3_qknorm", seed=2)
    cfg = model.config.replace(attention_impl="pallas")
    cache = _prefilled(model, [6, 3])
    t = 3
    toks = jnp.asarray([[5, 6, 7], [8, 9, 10]], jnp.int32)
    pos = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    slot = jnp.arange(cache.capacity)[None, None, :, None]  # caches [B, KV, S, hd]
    junk = slot >= cache.lengths[:, None, None, None]
    dirty = dataclasses.replace(cache, k=tuple(jnp.where(junk, jnp.nan, a) for a in cache.k),
                                v=tuple(jnp.where(junk, jnp.nan, a) for a in cache.v))
    clean_out = forward(cfg, model.weights, toks, pos, cache, Chain()).logits
    dirty_out = forward(cfg, model.weights, toks, pos, dirty, Chain()).logits
    assert not np.isnan(np.asarray(dirty_out)).any()
    np.testing.assert_allclose(np.asarray(dirty_out), np.asarray(clean_out), atol=1e-5)


def test_greedy_generate_identical_with_pallas_attention():
    from conftest import pad_prompts, tiny_model

    import jspec

    model = tiny_model("llama_tied_gqa2", seed=1)
    ids, lengths = pad_prompts([[5, 6, 7, 5, 6, 7, 5, 6], [20, 21], [30, 31, 30]])
    drafter = jspec.NGram(n_max=3)
    runs = {impl: jspec.generate(model, ids, lengths, max_new_tokens=12, drafter=drafter,
                                 length=jspec.FixedLength(3), attention_impl=impl)
            for impl in ("xla", "pallas")}
    np.testing.assert_array_equal(np.asarray(runs["pallas"].tokens), np.asarray(runs["xla"].tokens))
    np.testing.assert_array_equal(np.asarray(runs["pallas"].stats.accepted),
                                  np.asarray(runs["xla"].stats.accepted))
    assert (np.asarray(runs["xla"].lengths) > 1).all()


def test_attention_impl_resolution_and_validation():
    from jspec.errors import JspecError
    from jspec.models import ModelConfig
    from jspec.models.config import resolve_attention_impl

    assert resolve_attention_impl("auto", "cpu") == "xla"
    assert resolve_attention_impl("auto", "tpu") == "pallas"
    assert resolve_attention_impl("auto", "gpu") == "pallas"  # the Mosaic GPU kernel
    assert resolve_attention_impl("xla", "tpu") == "xla"
    assert resolve_attention_impl("pallas", "cpu") == "pallas"
    assert ModelConfig().attention_impl == "auto"
    with pytest.raises(JspecError, match="attention_impl"):
        ModelConfig(attention_impl="triton")
    with pytest.raises(JspecError, match="attention_impl"):
        resolve_attention_impl("cuda", "cpu")
    with pytest.raises(JspecError, match="backend"):
        resolve_attention_impl("auto", "cuda")


@pytest.mark.real
@pytest.mark.slow
def test_real_model_verification_forward_and_generate_with_the_kernels(real_model):
    """SmolLM2-135M: a tree-verification forward (per-row trees over a real prompt's cache)
    gives the XLA path's logits through the kernel (interpret mode); greedy speculative
    generation with the kernels for attention and acceptance is token-identical to XLA."""
    import jspec
    from jspec.models.cache import KVCache
    from jspec.models.llama import Tree, forward
    from jspec.verify import Lossless

    ids = real_model.encode("Write a Python function that returns the sum of a list.")
    p = len(ids)
    pallas_model = real_model.with_attention_impl("pallas")
    cfg_x, cfg_p = real_model.config.replace(attention_impl="xla"), pallas_model.config
    cache = KVCache.create(cfg_x, 2, 128)
    prompt = jnp.asarray([ids, ids], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (2, p))
    pre = forward(cfg_x, real_model.weights, prompt, pos, cache)
    cache = pre.cache.with_lengths(jnp.asarray([p, p - 3], jnp.int32))
    parents = jnp.asarray([[-1, 0, 0, 1, 2, 2], [-1, -1, 0, 1, 1, 4]], jnp.int32)
    toks = jnp.asarray([[30, 31, 32, 33, 34, 35], [40, 41, 42, 43, 44, 45]], jnp.int32)
    depth = jnp.asarray([[0, 1, 1, 2, 2, 2], [0, 0, 1, 2, 2, 3]], jnp.int32)
    tpos = cache.lengths[:, None] + depth
    outs = [forward(c, real_model.weights, toks, tpos, cache, mask=Tree(parents)).logits
            for c in (cfg_x, cfg_p)]
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(outs[0]), atol=2e-3, rtol=1e-4)

    row = np.asarray([ids])
    kw = dict(max_new_tokens=16, drafter=jspec.NGram(), length=jspec.FixedLength(4))
    ref = jspec.generate(real_model, row, **kw)
    out = jspec.generate(pallas_model, row, verifier=Lossless(acceptance_impl="pallas"), **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
