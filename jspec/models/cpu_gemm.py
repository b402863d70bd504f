"""Small-M matrix products on XLA:CPU through a native kernel (`cpu_gemm.cc`, the XLA FFI).

Verifying K drafted tokens multiplies K+1 rows by every weight matrix of the target. On a CPU
without bfloat16 matmul instructions XLA:CPU runs such a product as a packed GEMM that costs
about 1.5x a one-row product at M = 2 and 2-3x at M = 4-8 (docs/BENCHMARKS.md, "Small-M
products on the CPU"), which is why speculative decoding did not pay there. `cpu_gemm.cc`
reads each weight once per call and keeps the rows' partial sums in registers / L1: M = 2-8
rows cost about 1.0-1.5 one-row products. Built for a CPU with AVX512-BF16, a bfloat16 x
bfloat16 product takes VDPBF16PS (32 weights an instruction), which beats XLA's bfloat16 GEMM
there for up to 16 rows.

Built on first use with the host's C++ compiler (`$CXX`, else c++ / g++ / clang++;
`-O3 -march=native`, the XLA FFI headers that jaxlib ships) into `$JSPEC_CACHE/kernels/`,
keyed by the source, the compiler, jaxlib and the CPU; later processes load the cached
library. With no compiler, or if the build fails, jspec warns once and uses XLA's dot: the
same numbers up to summation order.

When it is used (decided at trace time, static): the default backend is the CPU, no
multi-device mesh is in context (a custom call has no sharding rule, so a sharded product stays
with XLA), the product has `1..MAX_ROWS` rows and is not a single float32 row (XLA streams
that as fast), and either the machine class is `cpu` (a CPU without AVX512-BF16 / AMX / Arm
BF16), or it is `cpu-bf16`, the build has the VDPBF16PS path (`bf16_dot()`), both operands are
bfloat16 and there are at most `MAX_ROWS_BF16` rows (measured faster than XLA's bfloat16 GEMM
there; float32 products stay with XLA). `$JSPEC_CPU_GEMM`: `0` never, `1` always where the shape allows (an
error if it cannot be built), unset: the rule.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

from jspec.errors import JspecError
from jspec.paths import cache_dir, cache_lock
from jspec.provenance import cpu_flags, machine_class

__all__ = ["ENV", "MAX_ROWS", "MAX_ROWS_BF16", "available", "bf16_dot", "reference", "small_gemm",
           "use_for"]

ENV = "JSPEC_CPU_GEMM"
MAX_ROWS = 32  # measured crossover with XLA's GEMM on the 2-core AVX2 machine: M = 32-48
MAX_ROWS_BF16 = 16  # on a cpu-bf16 machine, bfloat16 x bfloat16: level with XLA at 16 rows
TARGET = "jspec_small_gemm"
SOURCE = Path(__file__).with_suffix(".cc")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC", "-w")

log = logging.getLogger(__name__)
_BF16_DOT: list[bool] = []  # filled by _load(): whether the build has the VDPBF16PS path


def bf16_dot() -> bool:
    """Whether the kernel multiplies bfloat16 rows by bfloat16 weights with AVX512-BF16's
    VDPBF16PS (built for a CPU that has it; builds the kernel on first call)."""
    return _load() is None and _BF16_DOT[-1]


def _mode() -> str:
    v = os.environ.get(ENV, "")
    if v not in ("", "0", "1"):
        raise JspecError(f"${ENV} must be 0, 1 or unset, got {v!r}")
    return v


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _library_path(cxx: str) -> Path:
    """Where the build for this source, compiler, jaxlib and CPU lives."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    cpu = " ".join(sorted(cpu_flags()))
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, " ".join(FLAGS),
                                     jaxlib.__version__, platform.machine(), cpu])
                         .encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"cpu_gemm-{key}.so"


def _build(cxx: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: a reader never sees half a library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _load() -> str | None:
    """Build (once per machine) and register the kernel; None, or why it is unavailable."""
    cxx = _compiler()
    if cxx is None:
        return "no C++ compiler found ($CXX, c++, g++, clang++)"
    try:
        path = _library_path(cxx)
        if not path.exists():
            with cache_lock(f"build-{path.name}"):  # one build, however many processes start
                if not path.exists():
                    log.info("jspec: building the CPU small-M GEMM kernel (once) into %s", path)
                    _build(cxx, path)
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JspecSmallGemm),
                                    platform="cpu")
        _BF16_DOT.append(bool(lib.JspecSmallGemmBf16Dot()))
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def available() -> bool:
    """Whether the kernel is built and registered (builds it on first call). With
    `$JSPEC_CPU_GEMM=1` a failed build is an error; otherwise it is a one-time warning."""
    why = _load()
    if why is None:
        return True
    if _mode() == "1":
        raise JspecError(f"${ENV}=1 but the CPU GEMM kernel is unavailable: {why}")
    _warn_once(why)
    return False


@functools.cache
def _warn_once(why: str) -> None:
    log.warning("jspec: CPU small-M GEMM kernel unavailable (%s); using XLA's dot", why)


def _multi_device_context() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1


def use_for(rows: int, dtype: jnp.dtype, x_dtype: jnp.dtype | None = None) -> bool:
    """Whether a product of `rows` rows of `x_dtype` against a `dtype` weight takes the kernel
    (static), in a program compiled for CPU: callers ask this only inside the CPU branch of
    `jspec.platforms.choose`, never from the host's backend."""
    mode = _mode()
    if mode == "0" or _multi_device_context():
        return False
    if dtype not in (jnp.float32, jnp.bfloat16) or rows > MAX_ROWS or rows < 1:
        return False
    # One float32 row: XLA's matrix-vector product already streams the weights at memory
    # speed (measured equal or faster); a bfloat16 row takes XLA's slow emulated path.
    if rows == 1 and dtype == jnp.float32:
        return False
    cls = "any" if mode == "1" else machine_class()
    if cls in ("any", "cpu"):
        return available()
    if cls == "cpu-bf16":
        # bfloat16 x bfloat16 with VDPBF16PS: 0.75-0.9x XLA's bfloat16 product in a target
        # forward of 1-8 rows, level at 16 (docs/BENCHMARKS.md "bfloat16 products with
        # VDPBF16PS"); anything else there stays with XLA's (fast) bfloat16 GEMM.
        return (dtype == jnp.bfloat16 and x_dtype == jnp.bfloat16 and rows <= MAX_ROWS_BF16
                and available() and bf16_dot())
    return False


def reference(x: jax.Array, w: jax.Array, nt: bool) -> jax.Array:
    """The same product in XLA: f32[..., M, F] of x [..., M, D] and w [..., D, F] (nt: w
    [..., F, D]), float32 accumulation."""
    spec = "...md,...fd->...mf" if nt else "...md,...df->...mf"
    return jnp.einsum(spec, x.astype(jnp.float32), w.astype(jnp.float32))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def small_gemm(x: jax.Array, w: jax.Array, nt: bool = False) -> jax.Array:
    """f32[M, F] = x [M, D] @ w [D, F] (nt: w [F, D], i.e. x @ w.T), through the kernel.

    Args:
      x: float32 or bfloat16 [M, D] (converted to float32: exact).
      w: float32 or bfloat16 [D, F] (nt=False) or [F, D] (nt=True).
      nt: whether w is stored (out, in), as a tied embedding table is.
    Returns:
      f32[M, F]. Differentiable (the JVP is XLA's product); vmap passes batch dims through
      to the kernel (shared weights are not copied).
    """
    if x.ndim != 2 or w.ndim != 2:
        raise JspecError(f"small_gemm takes x [M, D] and w [D, F]; got {x.shape}, {w.shape}")
    if (why := _load()) is not None:
        raise JspecError(f"the CPU GEMM kernel is unavailable: {why}")
    d, f = (w.shape[1], w.shape[0]) if nt else w.shape
    if x.shape[1] != d:
        raise JspecError(f"small_gemm: x has {x.shape[1]} columns, w contracts over {d}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], f), jnp.float32),
                            vmap_method="expand_dims")
    xbf16 = x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16
    return call(x.astype(jnp.float32), w, nt=nt, xbf16=xbf16)


@small_gemm.defjvp
def _small_gemm_jvp(nt: bool, primals: tuple, tangents: tuple) -> tuple:
    x, w = primals
    dx, dw = tangents
    return small_gemm(x, w, nt), reference(dx, w, nt) + reference(x, dw, nt)
