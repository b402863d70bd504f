"""An exported drafter carries every field the serving engines' loaders read (vLLM, SGLang,
SpecForge, z-lab DFlash), and the files read back without torch."""

from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from test_interop import jspec_drafter

import jspec
from jspec.drafters import interop

# ----------------------------------------------------------------------------- engine loaders
# What each serving engine's loader reads from an EAGLE-3 config.json (vLLM
# llama_eagle3.py Eagle3LlamaForCausalLM / LlamaModel / LlamaDecoderLayer and its aux-layer
# helper; SGLang's model runner; SpecForge's LlamaForCausalLMEagle3).
VLLM_EAGLE3_FIELDS = {"architectures": list, "hidden_size": int, "vocab_size": int,
                      "draft_vocab_size": int, "num_hidden_layers": int,
                      "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int,
                      "intermediate_size": int, "hidden_act": str, "rms_norm_eps": float,
                      "max_position_embeddings": int, "rope_theta": float,
                      "attention_bias": bool, "mlp_bias": bool, "norm_before_residual": bool,
                      "target_hidden_size": int, "eagle_aux_hidden_state_layer_ids": list}
SGLANG_EAGLE3_FIELDS = {"eagle_config": dict}  # eagle_config.eagle_aux_hidden_state_layer_ids
SPECFORGE_EAGLE3_FIELDS = {"draft_vocab_size": int, "vocab_size": int, "hidden_size": int,
                           "intermediate_size": int, "num_attention_heads": int,
                           "num_key_value_heads": int, "rms_norm_eps": float,
                           "max_position_embeddings": int}
# z-lab dflash/model.py DFlashDraftModel and vLLM qwen3_dflash.py DFlashQwen3ForCausalLM.
DFLASH_FIELDS = {"architectures": list, "hidden_size": int, "num_hidden_layers": int,
                 "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int,
                 "intermediate_size": int, "hidden_act": str, "rms_norm_eps": float,
                 "rope_theta": float, "max_position_embeddings": int, "attention_bias": bool,
                 "vocab_size": int, "num_target_layers": int, "block_size": int,
                 "layer_types": list, "dflash_config": dict}


def _vllm_eagle3_params(cfg):
    """Eagle3LlamaForCausalLM's parameters (name -> shape) for a config."""
    d, h, kv, hd, f = (cfg["hidden_size"], cfg["num_attention_heads"],
                       cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"])
    n_aux = 3
    return {"model.layers.0.self_attn.qkv_proj.weight": ((h + 2 * kv) * hd, 2 * d),
            "model.layers.0.self_attn.o_proj.weight": (d, h * hd),
            "model.layers.0.mlp.gate_up_proj.weight": (2 * f, d),
            "model.layers.0.mlp.down_proj.weight": (d, f),
            "model.layers.0.input_layernorm.weight": (d,),
            "model.layers.0.hidden_norm.weight": (d,),
            "model.layers.0.post_attention_layernorm.weight": (d,),
            "model.fc.weight": (d, n_aux * d), "model.norm.weight": (d,),
            "lm_head.weight": (cfg["draft_vocab_size"], d),
            "draft_id_to_target_id": (cfg["draft_vocab_size"],),
            "model.embed_tokens.weight": (cfg["vocab_size"], d)}


def _vllm_eagle3_load(tensors):
    """vLLM's renaming of checkpoint tensors: (parameter, shard) -> shape."""
    out = {}
    for name, a in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name.replace("midlayer.", "layers.0.")
        for fused, part in ((".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"),
                            (".qkv_proj", ".v_proj"), (".gate_up_proj", ".gate_proj"),
                            (".gate_up_proj", ".up_proj")):
            if part in name:
                out.setdefault(name.replace(part, fused), []).append(a.shape)
                break
        else:
            out[name] = [a.shape]
    return out


def _check_fields(cfg, fields):
    for key, typ in fields.items():
        assert key in cfg, key
        val = cfg[key]
        assert isinstance(val, typ) or (typ is float and isinstance(val, int)), (key, val)


def test_eagle3_export_has_what_the_engines_read(tmp_path):
    model, native = jspec_drafter("eagle3")
    cfg = interop.export_drafter(native, tmp_path, "eagle3", target=model)
    assert json.loads((tmp_path / "config.json").read_text()) == cfg
    for fields in (VLLM_EAGLE3_FIELDS, SGLANG_EAGLE3_FIELDS, SPECFORGE_EAGLE3_FIELDS):
        _check_fields(cfg, fields)
    assert cfg["architectures"][0] in ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
    assert cfg["num_hidden_layers"] == 1 and cfg["model_type"] == "llama"
    # vLLM uses the top-level ids as capture indices; SGLang adds 1 to eagle_config's.
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(native.cfg.feature_layers)
    assert [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == list(
        native.cfg.feature_layers)
    tensors = interop.read_safetensors(tmp_path / "model.safetensors")
    loaded = _vllm_eagle3_load(tensors)
    want = _vllm_eagle3_params(cfg)
    assert set(loaded) <= set(want)
    assert set(want) - set(loaded) == {"model.embed_tokens.weight"}  # shared with the target
    for name, shapes in loaded.items():
        rows = sum(s[0] for s in shapes)
        assert (rows, *shapes[0][1:]) == want[name], name
    d2t = tensors["d2t"]
    np.testing.assert_array_equal(np.arange(len(d2t)) + d2t, np.asarray(native.vocab_ids))
    assert tensors["t2d"].dtype == np.bool_ and tensors["t2d"].sum() == len(d2t)
    # jspec's additions stay outside the engines' tensor file.
    assert cfg["jspec"]["feature_norm"] == "rms"
    extra = interop.read_safetensors(tmp_path / cfg["jspec"]["extra_tensors"])
    assert set(extra) == {"feat_mean", "feat_std", "vh_w", "vh_b"}


def test_dflash_export_has_what_the_engines_read(tmp_path):
    model, native = jspec_drafter("dflash")
    cfg = interop.export_drafter(native, tmp_path, "dflash", target=model)
    _check_fields(cfg, DFLASH_FIELDS)
    assert cfg["architectures"] == ["DFlashDraftModel"]
    dc = cfg["dflash_config"]
    assert [i + 1 for i in dc["target_layer_ids"]] == list(native.cfg.feature_layers)
    assert dc["block_size"] == cfg["block_size"] == native.cfg.block
    assert cfg["num_target_layers"] == model.config.num_layers
    tensors = interop.read_safetensors(tmp_path / "model.safetensors")
    names = {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    for i in range(native.cfg.num_layers):
        names |= {f"layers.{i}.{n}.weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
            "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")}
    assert set(tensors) == names
    assert tensors["fc.weight"].shape == (32, 2 * 32)
    # jspec's DFlash has no q/k norm and its own block inputs: said in the jspec section.
    assert cfg["jspec"]["qk_norm"] is False and cfg["jspec"]["block_input"] == "jspec"
    assert dc["mask_token_id"] is None
    extra = interop.read_safetensors(tmp_path / cfg["jspec"]["extra_tensors"])
    assert {"mask_emb", "slot_emb", "feat_mean", "feat_std"} <= set(extra)
    assert extra["slot_emb"].dtype == np.float32


def test_bfloat16_safetensors_read_without_torch(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    save_file({"x": a.astype(ml_dtypes.bfloat16), "i": np.arange(3, dtype=np.int64)},
              str(tmp_path / "t.safetensors"))
    back = interop.read_safetensors(tmp_path / "t.safetensors")
    np.testing.assert_array_equal(back["x"].astype(np.float32), a)
    assert back["i"].dtype == np.int64


def test_export_keeps_the_q_temperature(tmp_path):
    """A drafter's fitted q temperature travels in the export's jspec section and comes back;
    at 1 (the default) the section does not carry it."""
    model, native = jspec_drafter("eagle3")
    sharp = dataclasses.replace(native, cfg=dataclasses.replace(native.cfg, q_temperature=0.7))
    interop.export_drafter(sharp, tmp_path / "sharp", "eagle3", target=model)
    assert json.loads((tmp_path / "sharp" / "config.json").read_text())["jspec"][
        "q_temperature"] == 0.7
    assert jspec.load_drafter(str(tmp_path / "sharp"), target=model).cfg.q_temperature == 0.7
    interop.export_drafter(native, tmp_path / "plain", "eagle3", target=model)
    assert "q_temperature" not in json.loads(
        (tmp_path / "plain" / "config.json").read_text()).get("jspec", {})
    assert jspec.load_drafter(str(tmp_path / "plain"), target=model).cfg.q_temperature == 1.0
