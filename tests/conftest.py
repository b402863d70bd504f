"""Shared fixtures: tiny random models for unit tests, the real SmolLM2-135M for real-model tests."""

from __future__ import annotations

import os

import jax
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
jax.config.update("jax_default_matmul_precision", "highest")

import jspec  # noqa: E402
from jspec.models import ModelConfig, init_weights  # noqa: E402
from jspec.models.model import Model  # noqa: E402

TINY_VARIANTS = {
    "llama_tied_gqa2": ModelConfig(arch="llama", vocab_size=97, hidden_size=32, num_layers=2,
                                   num_heads=4, num_kv_heads=2, head_dim=8, ffn_size=48,
                                   eos_ids=(1,)),
    "llama_untied_mha": ModelConfig(arch="llama", vocab_size=97, hidden_size=32, num_layers=3,
                                    num_heads=4, num_kv_heads=4, head_dim=8, ffn_size=48,
                                    tie_embeddings=False, eos_ids=(1,)),
    "llama_mqa_scaled": ModelConfig(arch="llama", vocab_size=97, hidden_size=48, num_layers=2,
                                    num_heads=6, num_kv_heads=1, head_dim=8, ffn_size=64,
                                    rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                                                  ("low_freq_factor", 1.0),
                                                  ("original_max_position_embeddings", 64),
                                                  ("rope_type", "llama3")),
                                    eos_ids=(1,)),
    "qwen2_bias": ModelConfig(arch="qwen2", vocab_size=97, hidden_size=32, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=8, ffn_size=48,
                              qkv_bias=True, tie_embeddings=False, rope_theta=1e6, eos_ids=(1,)),
    "qwen3_qknorm": ModelConfig(arch="qwen3", vocab_size=97, hidden_size=32, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=16, ffn_size=48,
                                qk_norm=True, eos_ids=(1,)),
}


def tiny_model(name: str = "llama_tied_gqa2", seed: int = 0) -> Model:
    config = TINY_VARIANTS[name]
    return Model(config=config, weights=init_weights(config, jax.random.key(seed), scale=0.2),
                 name=name)


@pytest.fixture(scope="session")
def real_model() -> Model:
    """SmolLM2-135M-Instruct, converted once into $JSPEC_CACHE."""
    return jspec.load_model("smollm2-135m")
