"""Reading weights: GGUF files (via the `gguf` package) and Hugging Face safetensors directories.

Both paths produce one intermediate form, a dict of HF-named numpy arrays in (out, in) layout,
which `weights_from_hf` stacks into the `Weights` pytree. The registry caches a converted model
as an HF directory, so a second load is a plain safetensors read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jspec import safetensors_io
from jspec.errors import ModelLoadError
from jspec.models.blocks import LayerWeights
from jspec.models.config import SUPPORTED_ARCHS, ModelConfig
from jspec.models.llama import Weights

# GGUF tensor name suffix -> HF name suffix (per layer).
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE -> HF rotate-half). w: (out, in)."""
    d_out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, d_out // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(d_out, *rest)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (HF -> GGUF); the inverse of `unpermute_qk`."""
    d_out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, 2, d_out // n_head // 2, *rest).swapaxes(1, 2).reshape(d_out, *rest)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_gguf(path: str | os.PathLike, *, undo_qk_permutation: bool = True
              ) -> tuple[ModelConfig, dict[str, np.ndarray], Any]:
    """Read a GGUF file into (config, HF-named float32 tensors, tokenizer).

    `undo_qk_permutation=False` exists only so a test can show that skipping it breaks the model.
    """
    import gguf  # noqa: PLC0415 (import cost paid only when a GGUF is read)

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises assorted errors on a truncated or foreign file
        raise ModelLoadError(f"cannot read GGUF file {path} (truncated or not GGUF?): {e}") from e
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"GGUF {path.name} has architecture {arch!r}; jspec supports {SUPPORTED_ARCHS}")

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    required = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
    missing = [f"{arch}.{k}" for k in required if meta(k) is None]
    if missing:
        raise ModelLoadError(f"GGUF {path.name} lacks required metadata: {', '.join(missing)}")
    try:
        n_head = int(meta("attention.head_count"))
        n_kv = int(meta("attention.head_count_kv", n_head))
        hidden = int(meta("embedding_length"))
        tokens = _field(reader, "tokenizer.ggml.tokens")
        vocab = int(meta("vocab_size", len(tokens) if tokens is not None else 0))
        head_dim = int(meta("attention.key_length", hidden // n_head))
        scaling = None
        if meta("rope.scaling.type") not in (None, "none"):
            scaling = (("factor", float(meta("rope.scaling.factor"))),
                       ("rope_type", str(meta("rope.scaling.type"))))
        names = {t.name for t in reader.tensors}
        eos = _field(reader, "tokenizer.ggml.eos_token_id")
        config = ModelConfig(
            arch=arch, vocab_size=vocab, hidden_size=hidden, num_layers=int(meta("block_count")),
            num_heads=n_head, num_kv_heads=n_kv, head_dim=head_dim,
            ffn_size=int(meta("feed_forward_length")),
            rope_theta=float(meta("rope.freq_base", 10000.0)), rope_scaling=scaling,
            rms_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
            max_position=int(meta("context_length", 2048)),
            bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id", -1)),
            eos_ids=() if eos is None else (int(eos),))
    except (TypeError, ValueError, ZeroDivisionError) as e:  # incl. ModelConfig's JspecError
        raise ModelLoadError(f"GGUF {path.name} has invalid {arch} metadata: {e}") from e

    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name in _GGUF_TOP_NAMES:
            hf = _GGUF_TOP_NAMES[t.name]
        elif t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            if rest not in _GGUF_LAYER_NAMES:
                continue
            hf = f"model.layers.{idx}.{_GGUF_LAYER_NAMES[rest]}"
        else:
            continue
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"cannot dequantise {t.name} in {path}: {e}") from e
        w = np.asarray(w, np.float32).reshape([int(s) for s in reversed(t.shape)])
        # llama.cpp permutes Q/K rows for llama-arch files only (Qwen uses NeoX-style RoPE).
        if undo_qk_permutation and arch == "llama":
            if rest_is(hf, "q_proj"):
                w = unpermute_qk(w, n_head)
            elif rest_is(hf, "k_proj"):
                w = unpermute_qk(w, n_kv)
        tensors[hf] = w
    tokenizer = tokenizer_from_gguf(reader, arch) if tokens is not None else None
    return config, tensors, tokenizer


def rest_is(hf_name: str, proj: str) -> bool:
    return f"self_attn.{proj}." in hf_name


def tokenizer_from_gguf(reader: Any, arch: str) -> Any:
    """A transformers fast tokenizer built from GGUF metadata, without transformers' torch path."""
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # noqa: PLC0415
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    mapping = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tok_dict = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") and key[len("tokenizer."):] in mapping:
            tok_dict[mapping[key[len("tokenizer."):]]] = field.contents()
    backend, _ = convert_gguf_tokenizer(arch, tok_dict)
    vocab = tok_dict["tokens"]

    def special(key: str) -> str | None:
        i = tok_dict.get(key)
        return vocab[int(i)] if i is not None and 0 <= int(i) < len(vocab) else None

    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=special("bos_token_id"),
        eos_token=special("eos_token_id"), unk_token=special("unk_token_id"),
        pad_token=special("pad_token_id") or special("eos_token_id"))
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tok.chat_template = template
    return tok


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """ModelConfig from an HF config.json dict."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in _HF_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r} in config.json; jspec supports {SUPPORTED_ARCHS}")
    n_head = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if theta is None and isinstance(cfg.get("rope_parameters"), dict):
        rp = cfg["rope_parameters"]
        theta = rp.get("rope_theta")
        if rp.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    if isinstance(scaling, dict):
        scaling = tuple(sorted((k, v) for k, v in scaling.items()
                               if isinstance(v, (int, float, str))))
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    return ModelConfig(
        arch=model_type, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]), num_heads=n_head,
        num_kv_heads=int(cfg.get("num_key_value_heads") or n_head),
        head_dim=int(cfg.get("head_dim") or hidden // n_head),
        ffn_size=int(cfg["intermediate_size"]), rope_theta=float(theta or 10000.0),
        rope_scaling=scaling or None, rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type == "qwen3",
        max_position=int(cfg.get("max_position_embeddings", 2048)),
        bos_id=int(cfg["bos_token_id"]) if cfg.get("bos_token_id") is not None else -1,
        eos_ids=eos_ids)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """An HF config.json dict for `config` (so transformers can load a jspec-written directory)."""
    arch_cls = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    out: dict[str, Any] = {
        "architectures": [arch_cls[config.arch]], "model_type": config.arch,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "intermediate_size": config.ffn_size, "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_eps, "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_position, "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if config.arch == "llama":
        out["attention_bias"] = config.qkv_bias
    if config.rope_scaling is not None:
        out["rope_scaling"] = dict(config.rope_scaling)
    if config.bos_id >= 0:
        out["bos_token_id"] = config.bos_id
    if config.eos_ids:
        out["eos_token_id"] = list(config.eos_ids) if len(config.eos_ids) > 1 else config.eos_ids[0]
    return out


def read_hf_dir(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray], Any]:
    """Read an HF directory (config.json + *.safetensors [+ tokenizer files])."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{path} has no config.json (expected a Hugging Face model directory)")
    try:
        config = config_from_hf(json.loads(cfg_path.read_text()))
    except (KeyError, ValueError, TypeError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"bad config.json in {path}: {e}") from e
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            tensors.update(safetensors_io.read(f))  # memory-mapped, read-only
        except Exception as e:
            raise ModelLoadError(f"cannot read {f} (truncated or corrupt safetensors?): {e}") from e
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast  # noqa: PLC0415
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    return config, tensors, tokenizer


def _get(tensors: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
        raise ModelLoadError(f"missing tensor {name}")
    a = tensors[name]
    if tuple(a.shape) != shape:
        raise ModelLoadError(f"tensor {name} has shape {tuple(a.shape)}, expected {shape}")
    return a


def weights_from_hf(config: ModelConfig, tensors: dict[str, np.ndarray]) -> Weights:
    """HF-named (out, in) tensors -> the `Weights` pytree ((in, out), one entry per layer)."""
    d, f, h, kv, hd = (config.hidden_size, config.ffn_size, config.num_heads,
                       config.num_kv_heads, config.head_dim)
    dt = config.jnp_dtype

    def get(i: int, suffix: str, shape: tuple[int, ...], transpose: bool, dtype: Any = dt) -> Any:
        a = _get(tensors, f"model.layers.{i}.{suffix}", shape)
        return jnp.asarray(np.asarray(a.T if transpose else a, np.float32), dtype)

    def layer(i: int) -> LayerWeights:
        return LayerWeights(
            attn_norm=get(i, "input_layernorm.weight", (d,), False, jnp.float32),
            wq=get(i, "self_attn.q_proj.weight", (h * hd, d), True),
            wk=get(i, "self_attn.k_proj.weight", (kv * hd, d), True),
            wv=get(i, "self_attn.v_proj.weight", (kv * hd, d), True),
            wo=get(i, "self_attn.o_proj.weight", (d, h * hd), True),
            mlp_norm=get(i, "post_attention_layernorm.weight", (d,), False, jnp.float32),
            w_gate=get(i, "mlp.gate_proj.weight", (f, d), True),
            w_up=get(i, "mlp.up_proj.weight", (f, d), True),
            w_down=get(i, "mlp.down_proj.weight", (d, f), True),
            bq=get(i, "self_attn.q_proj.bias", (h * hd,), False) if config.qkv_bias else None,
            bk=get(i, "self_attn.k_proj.bias", (kv * hd,), False) if config.qkv_bias else None,
            bv=get(i, "self_attn.v_proj.bias", (kv * hd,), False) if config.qkv_bias else None,
            q_norm=get(i, "self_attn.q_norm.weight", (hd,), False, jnp.float32)
            if config.qk_norm else None,
            k_norm=get(i, "self_attn.k_norm.weight", (hd,), False, jnp.float32)
            if config.qk_norm else None)

    layers = tuple(layer(i) for i in range(config.num_layers))
    embed = jnp.asarray(_get(tensors, "model.embed_tokens.weight", (config.vocab_size, d)), dt)
    lm_head = None
    if not config.tie_embeddings:
        lm_head = jnp.asarray(_get(tensors, "lm_head.weight", (config.vocab_size, d)).T, dt)
    final = jnp.asarray(_get(tensors, "model.norm.weight", (d,)), jnp.float32)
    return Weights(embed=embed, layers=layers, final_norm=final, lm_head=lm_head)


def weights_to_hf(config: ModelConfig, weights: Weights) -> dict[str, np.ndarray]:
    """The inverse of `weights_from_hf`: HF-named float32 numpy arrays in (out, in) layout."""
    out: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": np.asarray(weights.embed, np.float32),
        "model.norm.weight": np.asarray(weights.final_norm, np.float32)}
    if weights.lm_head is not None:
        out["lm_head.weight"] = np.asarray(weights.lm_head, np.float32).T
    for i, lw in enumerate(weights.layers):
        names = [("input_layernorm.weight", lw.attn_norm, False),
                 ("self_attn.q_proj.weight", lw.wq, True), ("self_attn.k_proj.weight", lw.wk, True),
                 ("self_attn.v_proj.weight", lw.wv, True), ("self_attn.o_proj.weight", lw.wo, True),
                 ("post_attention_layernorm.weight", lw.mlp_norm, False),
                 ("mlp.gate_proj.weight", lw.w_gate, True), ("mlp.up_proj.weight", lw.w_up, True),
                 ("mlp.down_proj.weight", lw.w_down, True),
                 ("self_attn.q_proj.bias", lw.bq, False), ("self_attn.k_proj.bias", lw.bk, False),
                 ("self_attn.v_proj.bias", lw.bv, False),
                 ("self_attn.q_norm.weight", lw.q_norm, False),
                 ("self_attn.k_norm.weight", lw.k_norm, False)]
        for suffix, arr, transpose in names:
            if arr is not None:
                a = np.asarray(arr, np.float32)
                out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(a.T if transpose else a)
    return out


def write_hf_dir(path: str | os.PathLike, config: ModelConfig, tensors: dict[str, np.ndarray],
                 tokenizer: Any = None) -> None:
    """Write config.json, model.safetensors and the tokenizer as an HF directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_hf(config), indent=1))
    safetensors_io.write(path / "model.safetensors",
                         {k: np.asarray(v, np.float32) for k, v in tensors.items()})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
