"""The CPU small-M GEMM kernel (`jspec.models.cpu_gemm`): equal to XLA's product on every shape
class it handles (tails of the 4-row / 16-column / 8-element loops, batch dims, vmap, grad),
the rule that decides when `matmul` uses it, the fallback when it cannot be built, and a model
forward / greedy speculative decoding with it against XLA's dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.errors import JspecError
from jspec.models import cpu_gemm
from jspec.models.blocks import matmul

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")

DTYPES = {"float32": (jnp.float32, 2e-5), "bfloat16": (jnp.bfloat16, 2e-5)}
# (weight dtype, x dtype): bfloat16 x bfloat16 takes the VDPBF16PS path where it is built.
PAIRS = {"float32": (jnp.float32, jnp.float32), "bfloat16": (jnp.bfloat16, jnp.float32),
         "bfloat16-x": (jnp.bfloat16, jnp.bfloat16)}


def _rand(shape, dtype, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


@pytest.fixture(autouse=True)
def _built():
    if not cpu_gemm.available():
        pytest.skip("no C++ compiler here: the kernel falls back to XLA (tested below)")


@pytest.mark.parametrize("dtype", PAIRS)
@pytest.mark.parametrize("nt", [False, True])
@pytest.mark.parametrize("m, d, f", [(1, 64, 48), (2, 576, 192), (3, 37, 35), (5, 8, 16),
                                     (7, 100, 33), (16, 64, 300), (17, 12, 5), (6, 3, 1),
                                     (9, 70, 96), (4, 2, 40)])
def test_equals_xla(dtype, nt, m, d, f):
    """Every loop tail: D not a multiple of 4 / 8 / 32, F not a multiple of 16 / 32 / 4, M
    past the 2-row tile and the 8-row group of the VDPBF16PS path (`bfloat16-x`: both operands
    bfloat16). The reference is the float64 product of the same (bfloat16-rounded) values."""
    dt, xdt = PAIRS[dtype]
    tol = 2e-5
    x = _rand((m, d), xdt, 1)
    w = _rand((f, d) if nt else (d, f), dt, 2)
    got = jax.jit(cpu_gemm.small_gemm, static_argnums=2)(x, w, nt)
    wf = np.asarray(w.astype(jnp.float32), np.float64)
    want = np.asarray(x.astype(jnp.float32), np.float64) @ (wf.T if nt else wf)
    assert got.shape == (m, f) and got.dtype == jnp.float32
    assert _rel(got, want) < tol


@pytest.mark.parametrize("dtype", ["float32", "bfloat16-x"])
def test_nan_in_padding_does_not_leak(dtype):
    """Each output reads only its own row and column: a NaN row of x spoils only its row, a
    NaN weight column only its column (bfloat16-x: in the pairs the VDPBF16PS path makes)."""
    dt, xdt = PAIRS[dtype]
    x = _rand((5, 40), xdt, 3).at[2].set(jnp.nan)
    w = _rand((40, 37), dt, 4).at[:, 20].set(jnp.nan)
    got = np.asarray(cpu_gemm.small_gemm(x, w))
    bad = np.zeros_like(got, bool)
    bad[2] = True
    bad[:, 20] = True
    assert np.isnan(got[bad]).all() and np.isfinite(got[~bad]).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16-x"])
def test_vmap_batches_without_copying_shared_weights(dtype):
    dt, xdt = PAIRS[dtype]
    x = _rand((3, 4, 24), xdt, 5)
    w = _rand((24, 20), dt, 6)
    ws = _rand((3, 24, 20), dt, 7)
    ref = cpu_gemm.reference
    xf, wsf = x.astype(jnp.float32), ws.astype(jnp.float32)  # float32 references
    got = jax.vmap(lambda x: cpu_gemm.small_gemm(x, w))(x)
    assert _rel(got, ref(x, w, False)) < 1e-6
    got = jax.vmap(cpu_gemm.small_gemm)(x, ws)
    assert _rel(got, jnp.einsum("bmd,bdf->bmf", xf, wsf)) < 1e-6
    got = jax.vmap(lambda w: cpu_gemm.small_gemm(x[0], w))(ws)
    assert _rel(got, jnp.einsum("md,bdf->bmf", xf[0], wsf)) < 1e-6
    nested = jax.vmap(jax.vmap(cpu_gemm.small_gemm, in_axes=(0, None)), in_axes=(None, 0))(x, ws)
    assert nested.shape == (3, 3, 4, 20)
    assert _rel(nested, jnp.einsum("imd,jdf->jimf", xf, wsf)) < 1e-6
    # the weights went in once (a size-1 batch dim), not broadcast to the batch
    hlo = jax.jit(jax.vmap(lambda x: cpu_gemm.small_gemm(x, w))).lower(x).as_text()
    assert f"tensor<1x24x20x{'bf16' if dt == jnp.bfloat16 else 'f32'}>" in hlo


def test_gradients_are_xlas():
    x = _rand((3, 16), jnp.float32, 8)
    w = _rand((20, 16), jnp.float32, 9)

    def loss(fn):
        return lambda x, w: (fn(x, w, True) ** 2).sum()

    got = jax.grad(loss(cpu_gemm.small_gemm), argnums=(0, 1))(x, w)
    want = jax.grad(loss(cpu_gemm.reference), argnums=(0, 1))(x, w)
    for g, r in zip(got, want, strict=True):
        assert _rel(g, r) < 1e-5


def test_shape_errors_are_clear():
    with pytest.raises(JspecError, match="contracts over"):
        cpu_gemm.small_gemm(jnp.ones((2, 5)), jnp.ones((6, 3)))
    with pytest.raises(JspecError, match=r"x \[M, D\]"):
        cpu_gemm.small_gemm(jnp.ones((1, 2, 5)), jnp.ones((5, 3)))


def test_when_matmul_uses_it(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "machine_class", lambda: "cpu")
    monkeypatch.delenv(cpu_gemm.ENV, raising=False)
    f32, bf16 = jnp.float32, jnp.bfloat16
    assert cpu_gemm.use_for(2, f32) and cpu_gemm.use_for(16, f32)
    assert not cpu_gemm.use_for(1, f32)  # XLA's matrix-vector product is as fast
    assert cpu_gemm.use_for(1, bf16)  # XLA's one-row bfloat16 product is emulated and slow
    assert cpu_gemm.use_for(17, f32) and cpu_gemm.use_for(cpu_gemm.MAX_ROWS, f32)  # 17-node trees
    assert not cpu_gemm.use_for(cpu_gemm.MAX_ROWS + 1, f32) and not cpu_gemm.use_for(2, jnp.float16)
    monkeypatch.setattr(cpu_gemm, "machine_class", lambda: "cpu-bf16")
    assert not cpu_gemm.use_for(4, f32, f32)  # XLA's GEMM there
    assert not cpu_gemm.use_for(4, bf16, f32)  # float32 rows: XLA
    dot = cpu_gemm.bf16_dot()  # bfloat16 x bfloat16 takes VDPBF16PS where it is built
    assert cpu_gemm.use_for(1, bf16, bf16) == dot
    assert cpu_gemm.use_for(cpu_gemm.MAX_ROWS_BF16, bf16, bf16) == dot
    assert not cpu_gemm.use_for(cpu_gemm.MAX_ROWS_BF16 + 1, bf16, bf16)  # 17-node trees: XLA
    monkeypatch.setattr(cpu_gemm, "machine_class", lambda: "gpu")
    assert not cpu_gemm.use_for(4, bf16, bf16)
    monkeypatch.setenv(cpu_gemm.ENV, "1")
    assert cpu_gemm.use_for(4, f32) and cpu_gemm.use_for(1, bf16, f32)
    assert not cpu_gemm.use_for(1, f32)  # forced or not: XLA streams one float32 row as fast
    monkeypatch.setenv(cpu_gemm.ENV, "0")
    assert not cpu_gemm.use_for(4, f32)
    monkeypatch.setenv(cpu_gemm.ENV, "yes")
    with pytest.raises(JspecError, match="JSPEC_CPU_GEMM"):
        cpu_gemm.use_for(4, f32)

    # Under a multi-device mesh a custom call would gather sharded weights: XLA keeps it.
    monkeypatch.setenv(cpu_gemm.ENV, "1")
    mesh = jax.make_mesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    x, w = jnp.ones((1, 3, 8)), jnp.ones((8, 4))
    with jax.set_mesh(mesh):
        assert "ffi_call" not in str(jax.make_jaxpr(lambda x: matmul("...d,df->...f", x, w))(x))
    assert "ffi_call" in str(jax.make_jaxpr(lambda x: matmul("...d,df->...f", x, w))(x))


def test_unavailable_falls_back_or_fails_loudly(monkeypatch, caplog):
    """No compiler: `available()` is False with one warning and matmul keeps XLA's dot;
    with $JSPEC_CPU_GEMM=1 it is an error that says why."""
    monkeypatch.setattr(cpu_gemm, "_compiler", lambda: None)
    why = cpu_gemm._load.__wrapped__()
    assert "no C++ compiler" in why
    monkeypatch.setattr(cpu_gemm, "_load", lambda: why)
    monkeypatch.setattr(cpu_gemm, "machine_class", lambda: "cpu")
    monkeypatch.delenv(cpu_gemm.ENV, raising=False)
    with caplog.at_level("WARNING"):
        assert not cpu_gemm.use_for(4, jnp.float32)
    assert "using XLA's dot" in caplog.text
    monkeypatch.setenv(cpu_gemm.ENV, "1")
    with pytest.raises(JspecError, match="no C\\+\\+ compiler"):
        cpu_gemm.use_for(4, jnp.float32)


def test_a_failed_build_says_why(tmp_path, monkeypatch):
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_gemm, "SOURCE", bad)
    with pytest.raises(OSError, match="failed"):
        cpu_gemm._build(cpu_gemm._compiler(), tmp_path / "out.so")
    assert not (tmp_path / "out.so").exists() and list(tmp_path.iterdir()) == [bad]


@pytest.mark.parametrize("name, dtype, tol", [("llama_tied_gqa2", "float32", 1e-5),
                                              ("llama_untied_mha", "float32", 1e-5),
                                              ("llama_tied_gqa2", "bfloat16", 1e-3)])
def test_forward_and_greedy_decoding_with_the_kernel_equal_xla(name, dtype, tol, monkeypatch):
    """A verify-sized forward (T = 4: every projection and the LM head through the kernel,
    tied and untied) equals XLA's to float32 rounding (bfloat16: to the rounding of bfloat16
    activations between the layers; the VDPBF16PS path where it is built), and greedy
    speculative decoding with the kernel commits exactly the tokens of greedy decoding without
    it."""
    from conftest import tiny_model

    model = tiny_model(name).astype(dtype)
    ids = np.asarray([[5, 9, 13, 2, 7, 11]], np.int32)
    drafter = jspec.load_drafter("ngram", target=model)

    def run(mode):
        monkeypatch.setenv(cpu_gemm.ENV, mode)  # read at trace time: drop earlier traces
        jax.clear_caches()
        toks = jnp.asarray([[3, 8, 1, 4]], jnp.int32)
        logits = jax.jit(lambda w, t: jspec.models.forward(
            model.config, w, t, jnp.arange(4, dtype=jnp.int32)[None],
            jspec.models.KVCache.create(model.config, 1, 32)).logits)(model.weights, toks)
        jaxpr = str(jax.make_jaxpr(lambda w, t: jspec.models.forward(
            model.config, w, t, jnp.arange(4, dtype=jnp.int32)[None],
            jspec.models.KVCache.create(model.config, 1, 32)).logits)(model.weights, toks))
        out = jspec.generate(model, ids, max_new_tokens=24, drafter=drafter,
                             length=jspec.FixedLength(3))
        return np.asarray(logits), np.asarray(out.tokens), jaxpr

    ker, ker_tokens, ker_jaxpr = run("1")
    xla, xla_tokens, xla_jaxpr = run("0")
    assert "ffi_call" in ker_jaxpr and "ffi_call" not in xla_jaxpr
    assert _rel(ker, xla) < tol
    np.testing.assert_array_equal(ker_tokens, xla_tokens)
