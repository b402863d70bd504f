"""Export of jspec drafters as community checkpoint directories (`jspec.drafters.interop`):
EAGLE-3 (SpecForge / vLLM `LlamaForCausalLMEagle3`) and DFlash (z-lab `DFlashDraftModel`)
layouts, with jspec's additions in a `jspec` config section and `jspec_extra.safetensors`;
`python -m train export`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jspec.drafters import kinds
from jspec.drafters.st_io import EXTRA_FILE, FORMATS, WEIGHTS_FILE, write_safetensors
from jspec.drafters.trained import DrafterConfig, check_target, draft_head, to_flat
from jspec.errors import JspecError


def _np(a: Any, transpose: bool = False) -> np.ndarray:
    a = np.asarray(jnp.asarray(a, jnp.float32))
    return np.ascontiguousarray(a.T) if transpose else a


def _rope_fields(cfg: DrafterConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_theta": cfg.rope_theta}
    out["rope_scaling"] = None if cfg.rope_scaling is None else dict(cfg.rope_scaling)
    return out


def _vocab_tensors(vocab_ids: np.ndarray, v: int) -> dict[str, np.ndarray]:
    ids = np.asarray(vocab_ids, np.int64)
    t2d = np.zeros((v,), np.bool_)
    t2d[ids] = True
    return {"d2t": ids - np.arange(len(ids), dtype=np.int64), "t2d": t2d}


def _eagle3_layout(cfg: DrafterConfig, p: dict[str, Any], tc: Any, common: dict[str, Any],
                   jsec: dict[str, Any], tensors: dict[str, np.ndarray]
                   ) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The EAGLE-3 layout's tensors (into `tensors`) and config.json; the extra tensors' keys."""
    d = cfg.hidden_size
    tensors.update({
        "midlayer.input_layernorm.weight": _np(p["norm_emb"]),
        "midlayer.hidden_norm.weight": _np(p["norm_feat"]),
        "midlayer.post_attention_layernorm.weight": _np(p["mlp_norm"]),
        "midlayer.self_attn.q_proj.weight": _np(p["wq"], True),
        "midlayer.self_attn.k_proj.weight": _np(p["wk"], True),
        "midlayer.self_attn.v_proj.weight": _np(p["wv"], True),
        "midlayer.self_attn.o_proj.weight": _np(p["wo"], True),
        "midlayer.mlp.gate_proj.weight": _np(p["w_gate"], True),
        "midlayer.mlp.up_proj.weight": _np(p["w_up"], True),
        "midlayer.mlp.down_proj.weight": _np(p["w_down"], True)})
    layers = list(cfg.feature_layers)
    config = {"architectures": ["LlamaForCausalLMEagle3"], **common,
              "mlp_bias": False, "norm_before_residual": cfg.norm_before_residual,
              "target_hidden_size": d,
              # vLLM reads the top-level ids as capture indices (jspec's numbering);
              # SGLang / SpecForge read eagle_config's as 0-indexed layer outputs.
              "eagle_aux_hidden_state_layer_ids": layers,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers],
                               "use_aux_hidden_state": True}}
    jsec["block"] = cfg.block
    return config, _STD_KEYS


def _dflash_layout(cfg: DrafterConfig, p: dict[str, Any], tc: Any, common: dict[str, Any],
                   jsec: dict[str, Any], tensors: dict[str, np.ndarray]
                   ) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The DFlash layout's tensors (into `tensors`) and config.json; the extra tensors' keys."""
    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        tensors.update({
            pre + "input_layernorm.weight": _np(p[f"l{i}.attn_norm"]),
            pre + "post_attention_layernorm.weight": _np(p[f"l{i}.mlp_norm"]),
            pre + "self_attn.q_proj.weight": _np(p[f"l{i}.wq"], True),
            pre + "self_attn.k_proj.weight": _np(p[f"l{i}.wk"], True),
            pre + "self_attn.v_proj.weight": _np(p[f"l{i}.wv"], True),
            pre + "self_attn.o_proj.weight": _np(p[f"l{i}.wo"], True),
            pre + "mlp.gate_proj.weight": _np(p[f"l{i}.w_gate"], True),
            pre + "mlp.up_proj.weight": _np(p[f"l{i}.w_up"], True),
            pre + "mlp.down_proj.weight": _np(p[f"l{i}.w_down"], True)})
        if cfg.qk_norm:
            tensors[pre + "self_attn.q_norm.weight"] = _np(p[f"l{i}.q_norm"])
            tensors[pre + "self_attn.k_norm.weight"] = _np(p[f"l{i}.k_norm"])
    tensors["hidden_norm.weight"] = _np(p["fc_norm"])
    if min(cfg.feature_layers) < 1:
        raise JspecError("the DFlash layout cannot name the embeddings (feature layer 0)")
    config = {"architectures": ["DFlashDraftModel"], **common,
              "num_target_layers": tc.num_layers, "block_size": cfg.block,
              "layer_types": ["full_attention"] * cfg.num_layers,
              "dflash_config": {"block_size": cfg.block,
                                "mask_token_id": (cfg.mask_token_id
                                                  if cfg.block_input == "tokens" else None),
                                "target_layer_ids": [i - 1 for i in cfg.feature_layers]}}
    jsec.update(qk_norm=cfg.qk_norm, block_input=cfg.block_input)
    return config, (*_STD_KEYS, "mask_emb", "slot_emb")


@dataclasses.dataclass(frozen=True)
class _Layout:
    model_type: str  # config.json's model_type
    full_head: bool  # as released it reads the target's full LM head: none written when it is that
    write: Callable[..., tuple[dict[str, Any], tuple[str, ...]]]  # `_eagle3_layout`'s signature


_STD_KEYS = ("feat_mean", "feat_std", "vh_w", "vh_b")
# Each community format's writer (its reader: `interop.READERS`).
LAYOUTS = {"eagle3": _Layout("llama", False, _eagle3_layout),
           "dflash": _Layout("qwen3", True, _dflash_layout)}


def export_drafter(drafter: Any, out: str | Path, fmt: str, *, target: Any,
                   dtype: str = "float32") -> dict[str, Any]:
    """Write `drafter` (a jspec Eagle3 / DFlash) as an EAGLE-3 or DFlash checkpoint directory.

    Args:
      drafter: the loaded drafter (`jspec.load_drafter`).
      out: the directory to write (config.json, model.safetensors, maybe jspec_extra).
      fmt: "eagle3" or "dflash" (must match the drafter).
      target: the target Model (its layer count, context length, embedding).
      dtype: "float32" (exact for any drafter) or "bfloat16" (exact for bfloat16-trained ones).
    Returns:
      the config.json dict written.
    """
    if fmt not in FORMATS:
        raise JspecError(f"unknown export format {fmt!r} (one of {FORMATS})")
    want, layout = kinds.by_checkpoint(fmt).drafter, LAYOUTS[fmt]
    if not isinstance(drafter, want):
        raise JspecError(f"--format {fmt} needs a {want.__name__} drafter, got "
                         f"{type(drafter).__name__}")
    if dtype not in ("float32", "bfloat16"):
        raise JspecError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    cfg, p = drafter.cfg, to_flat(drafter.params)
    tc = target.config
    check_target(cfg, tc)
    d, v = cfg.hidden_size, cfg.target_vocab
    tensors: dict[str, np.ndarray] = {"fc.weight": _np(p["fc"], True),
                                      "norm.weight": _np(p["final_norm"])}
    vocab = np.asarray(drafter.vocab_ids)
    # DFlash as released reads the target's full LM head: write a head only when it is not that.
    full_target_head = (layout.full_head and cfg.draft_vocab == v
                        and np.array_equal(vocab, np.arange(v))
                        and np.array_equal(_np(drafter.head),
                                           _np(draft_head(vocab, target.weights))))
    if not full_target_head:
        tensors["lm_head.weight"] = _np(drafter.head)
        tensors.update(_vocab_tensors(vocab, v))
    if not np.array_equal(np.asarray(drafter.embed, np.float32),
                          np.asarray(target.weights.embed, np.float32)):
        tensors["embed_tokens.weight"] = _np(drafter.embed)
    common = {"model_type": layout.model_type,
              "hidden_size": d, "intermediate_size": cfg.ffn_size,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
              "head_dim": cfg.head_dim, "num_hidden_layers": cfg.num_layers,
              "rms_norm_eps": cfg.rms_eps, **_rope_fields(cfg),
              "max_position_embeddings": tc.max_position, "vocab_size": v,
              **({} if full_target_head else {"draft_vocab_size": cfg.draft_vocab}),
              "hidden_act": "silu",
              "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": dtype}
    jsec: dict[str, Any] = {"format": 1, "target": cfg.target, "feature_norm": cfg.feature_norm,
                            "vat": cfg.vat,
                            **({} if cfg.q_temperature == 1.0 else
                               {"q_temperature": cfg.q_temperature})}
    config, extra_keys = layout.write(cfg, p, tc, common, jsec, tensors)
    extra = {k: _np(p[k]) for k in extra_keys if k in p}
    if cfg.feature_norm == "none":  # an imported checkpoint: drop jspec's identity defaults
        extra = {k: a for k, a in extra.items() if not _is_default(k, a)}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if extra:
        jsec["extra_tensors"] = EXTRA_FILE
        write_safetensors(out / EXTRA_FILE, extra)
    elif (out / EXTRA_FILE).exists():
        (out / EXTRA_FILE).unlink()
    if (cfg.feature_norm == "none" and not extra and not cfg.target and not cfg.vat
            and cfg.q_temperature == 1.0):
        pass  # a plain community checkpoint: no jspec section needed
    else:
        config["jspec"] = jsec
    if dtype == "bfloat16":
        tensors = {k: a.astype(ml_dtypes.bfloat16) if a.dtype == np.float32 else a
                   for k, a in tensors.items()}
    write_safetensors(out / WEIGHTS_FILE, tensors)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def _is_default(key: str, a: np.ndarray) -> bool:
    if key == "feat_std":
        return bool(np.all(a == 1.0))
    if key in ("feat_mean", "vh_w", "vh_b"):
        return bool(np.all(a == 0.0))
    return False
