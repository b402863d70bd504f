"""Static model configuration: a frozen, hashable dataclass that passes through `jit` as-is."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from jspec.errors import JspecError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
ATTENTION_IMPLS = ("auto", "xla", "pallas")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder. Changing any field recompiles.

    Attributes:
      arch: "llama" | "qwen2" (q/k/v bias) | "qwen3" (q/k RMSNorm).
      vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim, ffn_size: shapes.
      rope_theta: RoPE base. rope_scaling: sorted (key, value) pairs of the HF `rope_scaling`
        dict (hashable), or None.
      rms_eps: RMSNorm epsilon.
      tie_embeddings: LM head is the transposed token embedding.
      qkv_bias: q/k/v projections have biases (Qwen2).
      qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
      max_position: the model's trained context length.
      bos_id: beginning-of-sequence token id (or -1). eos_ids: ids that end a sequence.
      dtype: "float32" or "bfloat16": the weights' and activations' dtype. Norms, softmax and
        logits are always float32.
      attention_impl: "xla" (masked attention over the whole cache buffer), "pallas" (the
        `pallas_kernels.tree_attention` kernel for verify/decode steps; interpret mode on CPU)
        or "auto" (pallas on TPU and GPU, xla on CPU; see `resolve_attention_impl`).
      scan_layers: the weights hold all layers as one stack ([L, ...] per field) and the
        forward is a `lax.scan` over them, the KV cache one [L, B, KV, S, hd] buffer; False:
        one buffer per layer, the layers unrolled. Scanned is the layout for TPU (an 8B
        `generate` compiles several times faster, docs/TPU.md); unrolled for CPU, where a
        matmul that reads a slice of a stacked weight copies it first (`LayerWeights`).
        `Model.with_scan_layers` converts a model.
    """

    arch: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn_size: int = 128
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position: int = 2048
    bos_id: int = -1
    eos_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    attention_impl: str = "auto"
    scan_layers: bool = False

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise JspecError(f"unsupported architecture {self.arch!r}; jspec supports {SUPPORTED_ARCHS}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "ffn_size", "max_position"):
            if int(getattr(self, name)) < 1:
                raise JspecError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise JspecError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise JspecError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in _DTYPES:
            raise JspecError(f"dtype must be one of {tuple(_DTYPES)}, got {self.dtype!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise JspecError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        if self.rope_scaling is not None:
            kind = dict(self.rope_scaling).get("rope_type", dict(self.rope_scaling).get("type"))
            if kind not in ("default", "linear", "llama3"):
                raise JspecError(f"unsupported rope_scaling type {kind!r} (default, linear, llama3)")

    @property
    def jnp_dtype(self) -> Any:
        return _DTYPES[self.dtype]

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    def inv_freq(self) -> np.ndarray:
        """f32[head_dim // 2] RoPE inverse frequencies, with rope scaling applied (host-side)."""
        inv = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
        if self.rope_scaling is None:
            return inv.astype(np.float32)
        rs = dict(self.rope_scaling)
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "linear":
            inv = inv / float(rs["factor"])
        elif kind == "llama3":
            factor = float(rs["factor"])
            low = float(rs.get("low_freq_factor", 1.0))
            high = float(rs.get("high_freq_factor", 4.0))
            orig = float(rs.get("original_max_position_embeddings", 8192))
            low_wl, high_wl = orig / low, orig / high
            wavelen = 2 * math.pi / inv
            smooth = (orig / wavelen - low) / (high - low)
            scaled = np.where(wavelen > low_wl, inv / factor, inv)
            mid = (1 - smooth) * scaled / factor + smooth * scaled
            is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
            inv = np.where(is_mid, mid, scaled)
        return inv.astype(np.float32)


# Platforms where "auto" picks the Pallas kernel: TPU (Mosaic kernel) and GPU (Mosaic GPU kernel,
# which passed `python -m pallas_kernels.bench` on an H200, docs/BENCHMARKS.md). On a GPU, "auto"
# still takes the XLA path for a step the GPU kernel does not take (float32, head_dim not 64/128,
# more than 64 new tokens, capacity not a multiple of 64): see `llama.forward`.
AUTO_PALLAS_BACKENDS = ("tpu", "gpu")


def resolve_attention_impl(impl: str, backend: str) -> str:
    """"xla" or "pallas" for `impl` in ("auto", "xla", "pallas") in a program compiled for
    `backend` ("cpu" | "gpu" | "tpu": the platform of the program's devices, never the host's).

    Returns:
      "pallas" for "pallas", and for "auto" on a backend in AUTO_PALLAS_BACKENDS; else "xla".
    """
    if impl not in ATTENTION_IMPLS:
        raise JspecError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if backend not in ("cpu", "gpu", "tpu"):
        raise JspecError(f"backend must be 'cpu', 'gpu' or 'tpu', got {backend!r}")
    if impl != "auto":
        return impl
    return "pallas" if backend in AUTO_PALLAS_BACKENDS else "xla"
