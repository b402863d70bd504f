"""Community drafter checkpoints: EAGLE-3 (SpecForge / vLLM / SGLang) and DFlash (z-lab), both ways.

`load_checkpoint(DIR, target)` (what `jspec.load_drafter(DIR, target=model)` calls for such a
directory) turns a checkpoint directory (`config.json` + `*.safetensors`) into jspec's own
`Eagle3` / `DFlash` drafter; `export_drafter` writes jspec's drafters in the same layouts
(`python -m train export`). Only public reference code was read to pin the layouts down:
SpecForge's `LlamaForCausalLMEagle3`, vLLM's `llama_eagle3.py` / `qwen3_dflash.py` and their
aux-layer selection, SGLang's `set_eagle3_layers_to_capture`, z-lab's `dflash/model.py`.

EAGLE-3 (`architectures`: `LlamaForCausalLMEagle3` or `Eagle3LlamaForCausalLM`)
  tensors ([out, in], as torch stores them; `midlayer.` or `layers.0.`):
    fc.weight [D, 3D]; midlayer.hidden_norm.weight, midlayer.input_layernorm.weight,
    midlayer.post_attention_layernorm.weight [D]; midlayer.self_attn.{q,k,v}_proj.weight
    [H*hd | KV*hd, 2D]; midlayer.self_attn.o_proj.weight [D, H*hd];
    midlayer.mlp.{gate,up}_proj.weight [F, D], down_proj [D, F]; norm.weight [D];
    lm_head.weight [Vd, D]; d2t i64[Vd] (target id = draft id + d2t[draft id]); t2d bool[V];
    optional embed_tokens.weight [V, D] (absent: the target's embedding, as vLLM shares it).
  forward (one entry per position s, RoPE position s): g = fc(concat h_a, h_b, h_c) of the
    target's *raw* hidden states; x = [input_layernorm(emb(token s+1)), hidden_norm(g)] (2D)
    into q/k/v; residual g (`norm_before_residual`: hidden_norm(g)); post_attention_layernorm
    + SwiGLU MLP; the pre-norm output feeds the next chained step, `norm` + lm_head gives
    logits. That is jspec's `Eagle3` with fc <- fc, norm_emb <- input_layernorm, norm_feat <-
    hidden_norm, final_norm <- norm, its own head <- lm_head, and `feature_norm="none"`
    (jspec's own drafters divide each feature by its RMS and standardise it; the option keeps
    one drafter, not two).
  layers: top-level `eagle_aux_hidden_state_layer_ids` (vLLM: capture index i = the input of
    decoder layer i = HF `hidden_states[i]` = jspec feature layer i, used as is), else
    `eagle_config.eagle_aux_hidden_state_layer_ids` (SpecForge / SGLang: the output of
    0-indexed layer j, SGLang adds 1: jspec layer j + 1), else the default of all three,
    (2, L//2, L-3) in jspec's numbering (SpecForge's [1, L//2-1, L-4]).
  RoPE: `rope_theta` / `rope_scaling` (or transformers-5 `rope_parameters`) as vLLM serves
    them. (SpecForge trains a `llama3`-scaled config with unscaled RoPE; such a checkpoint
    served by vLLM has the same mismatch.)
DFlash (`architectures`: `DFlashDraftModel`, a Qwen3-style stack; DFlash2 is refused)
  tensors: fc.weight [D, n*D]; hidden_norm.weight [D]; norm.weight [D]; per layer i
    layers.i.{input_layernorm, post_attention_layernorm}.weight [D],
    layers.i.self_attn.{q,k,v,o}_proj.weight, layers.i.self_attn.{q,k}_norm.weight [hd],
    layers.i.mlp.{gate,up,down}_proj.weight; no head or embedding (the target's, full
    vocabulary); optional lm_head.weight + d2t (a draft vocabulary, as vLLM reads it).
  forward: context c = hidden_norm(fc(concat of raw hidden states)) at positions < a, whose
    per-layer k (k_norm, RoPE) / v join the keys of the block [anchor, MASK x (γ-1)] (target
    embeddings of the anchor and of `mask_token_id`) at positions a..a+γ-1; no mask (the block
    sees the whole context and itself); norm + the target's LM head. jspec's `DFlash` with
    `feature_norm="none"`, `qk_norm=True`, `block_input="tokens"`.
  fields: `dflash_config.mask_token_id` (required), `dflash_config.target_layer_ids` (0-indexed
    layer outputs, HF `hidden_states[j + 1]`: jspec layer j + 1; vLLM adds the same 1; absent:
    the release's `build_target_layer_ids(num_target_layers, num_hidden_layers)`),
    `block_size` (top level or in dflash_config; the release's default 16).
Both: an unknown field, a missing required one, an unsupported value (sliding-window layers,
  causal DFlash, attention biases, soft-capping, ...) or a tensor that is missing, unexpected or
  of the wrong shape is a `JspecError` naming it. A hidden state the config asks for at the
  target's last layer is refused: HF's `hidden_states[L]` is after the final norm, jspec's is not.

Export writes the same names and fields. jspec's own drafters differ from those architectures
(features RMS-normalised and standardised; DFlash: jspec's block inputs, no q/k norm, a VAT
head), so the export also carries a `jspec` section in config.json and `jspec_extra.safetensors`
(feat_mean, feat_std, vh_w, vh_b, mask_emb, slot_emb); jspec re-imports it exactly. vLLM and
SGLang load those directories (same tensor names and fields) but compute without jspec's
additions, so their drafts from a jspec-trained export are poor (verification keeps the output
exact). Exporting an imported community checkpoint writes its tensors back unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jspec.drafters import kinds
from jspec.drafters.ckpt_fields import (  # noqa: F401  (re-exported)
    DFLASH_ARCHS,
    EAGLE3_ARCHS,
    REFUSED_ARCHS,
    _architecture,
    _Fields,
    _no_sliding_window,
    _rope,
    checkpoint_kind,
)
from jspec.drafters.interop_export import export_drafter  # noqa: F401  (re-exported)
from jspec.drafters.st_io import (  # noqa: F401  (re-exported)
    EXTRA_FILE,
    FORMATS,
    IGNORED,
    WEIGHTS_FILE,
    _read_dir_tensors,
    read_safetensors,
    write_safetensors,
)
from jspec.drafters.trained import DrafterConfig, check_target, from_flat
from jspec.errors import JspecError
from jspec.models.model import load_model

Flat = dict[str, Any]  # parameters by their flat names (`trained.to_flat`)


class _Tensors:
    """The checkpoint's tensors, taken one by one with shape checks; leftovers are errors."""

    def __init__(self, tensors: dict[str, np.ndarray], where: str):
        self.t, self.where, self.used = tensors, where, set()

    def take(self, names: str | tuple[str, ...], shape: tuple[int, ...], required: bool = True
             ) -> np.ndarray | None:
        names = (names,) if isinstance(names, str) else names
        for n in names:
            if n in self.t:
                self.used.add(n)
                a = self.t[n]
                if tuple(a.shape) != shape:
                    raise JspecError(f"{self.where}: tensor {n} has shape {tuple(a.shape)}, "
                                     f"expected {shape}")
                return a
        if required:
            raise JspecError(f"{self.where}: missing tensor {names[0]} {shape}")
        return None

    def finish(self) -> None:
        extra = sorted(set(self.t) - self.used)
        if extra:
            raise JspecError(f"{self.where}: unexpected tensor(s) {extra[:8]}"
                             f"{' ...' if len(extra) > 8 else ''}")


def _f32(a: np.ndarray, transpose: bool = False) -> Any:
    a = np.asarray(a, np.float32)
    return jnp.asarray(np.ascontiguousarray(a.T) if transpose else a)


def _vocab(t: _Tensors, vd: int, v: int, where: str) -> np.ndarray:
    """i32[Vd] target ids of the draft vocabulary from d2t offsets (t2d checked if present)."""
    d2t = t.take("d2t", (vd,), required=False)
    t2d = t.take("t2d", (v,), required=False)
    if d2t is None:
        if vd != v:
            raise JspecError(f"{where}: draft_vocab_size {vd} != vocab_size {v} needs a d2t "
                             "tensor")
        return np.arange(v, dtype=np.int32)
    ids = np.arange(vd, dtype=np.int64) + np.asarray(d2t, np.int64)
    if ids.min() < 0 or ids.max() >= v or len(np.unique(ids)) != vd:
        raise JspecError(f"{where}: d2t maps draft ids outside [0, {v}) or onto one target id "
                         "twice (target id = draft id + d2t[draft id])")
    if t2d is not None:
        t2d = np.asarray(t2d).astype(bool)
        if int(t2d.sum()) != vd or not t2d[ids].all():
            raise JspecError(f"{where}: t2d does not mark exactly the target ids of d2t")
    return ids.astype(np.int32)


def _jspec_section(f: _Fields, path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The `jspec` section of an export and its extra tensors ({} for community files)."""
    sec = f.get("jspec", dict, {})
    j = _Fields(sec, f"{f.where}: jspec", frozenset())
    out = {"feature_norm": j.get("feature_norm", str, "none"),
           "target": j.get("target", str, ""), "vat": j.get("vat", bool, False),
           "block": j.get("block", int), "qk_norm": j.get("qk_norm", bool),
           "block_input": j.get("block_input", str),
           "q_temperature": j.get("q_temperature", float, 1.0)}
    j.get("format", int)
    extra_name = j.get("extra_tensors", str)
    j.finish()
    extra = {}
    if extra_name:
        if not (path / extra_name).is_file():
            raise JspecError(f"{path}: the jspec section names {extra_name}, which is missing")
        extra = read_safetensors(path / extra_name)
    return out, extra


# ----------------------------------------------------------------------------- import
def _layer_ids_eagle3(f: _Fields, num_target_layers: int) -> tuple[int, ...]:
    top = f.get("eagle_aux_hidden_state_layer_ids", list)
    ec = _Fields(f.get("eagle_config", dict, {}), f"{f.where}: eagle_config")
    nested = ec.get("eagle_aux_hidden_state_layer_ids", list)
    ec.expect("use_aux_hidden_state", (True,), "EAGLE-3 reads the fused target hidden states")
    ec.finish()
    if top is not None and nested is not None and [int(i) for i in top] != [
            int(i) + 1 for i in nested]:
        raise JspecError(f"{f.where}: eagle_aux_hidden_state_layer_ids {top} (vLLM: input of "
                         f"layer i) and eagle_config.eagle_aux_hidden_state_layer_ids {nested} "
                         "(SpecForge/SGLang: output of layer i) name different layers")
    if top is not None:
        return tuple(int(i) for i in top)
    if nested is not None:
        return tuple(int(i) + 1 for i in nested)
    n = num_target_layers
    return (2, n // 2, n - 3)


def _read_eagle3(path: Path, cfg: dict[str, Any], target_config: Any
                 ) -> tuple[DrafterConfig, Flat, np.ndarray, Any, Any]:
    f = _Fields(cfg, str(path / "config.json"), IGNORED)
    f.get("architectures", list)
    # vLLM builds the same Llama layer whatever the config class says; only LlamaConfig's
    # head_dim default is hidden // heads (Qwen3Config's is 128), so others must give it.
    f.expect("model_type", ("llama", "qwen2", "qwen3"), "EAGLE-3 drafters are Llama layers")
    d = f.get("hidden_size", int, required=True)
    v = f.get("vocab_size", int, required=True)
    ffn = f.get("intermediate_size", int, required=True)
    h = f.get("num_attention_heads", int, required=True)
    kv = f.get("num_key_value_heads", int, h)
    hd = f.get("head_dim", int, d // h, required=cfg.get("model_type", "llama") != "llama")
    n_layers = f.get("num_hidden_layers", int, required=True)
    if n_layers != 1:
        raise JspecError(f"{f.where}: num_hidden_layers = {n_layers}: jspec's EAGLE-3 has one "
                         "decoder layer")
    vd = f.get("draft_vocab_size", int, v)
    eps = f.get("rms_norm_eps", float, 1e-6)
    theta, scaling = _rope(f, hd)
    f.expect("hidden_act", ("silu",))
    f.expect("attention_bias", (False,))
    f.expect("mlp_bias", (False,))
    f.expect("qkv_bias", (False,))
    f.expect("pretraining_tp", (1,))
    f.expect("logit_scale", (1, 1.0))
    f.expect("is_causal", (True,))
    nbr = f.get("norm_before_residual", bool, False)
    ths = f.get("target_hidden_size", int, d)
    if ths != d:
        raise JspecError(f"{f.where}: target_hidden_size {ths} != hidden_size {d} is not "
                         "supported")
    _no_sliding_window(f)
    layers = _layer_ids_eagle3(f, target_config.num_layers)
    js, extra = _jspec_section(f, path)
    f.finish()
    nf = len(layers)
    t = _Tensors(_read_dir_tensors(path), str(path))

    def mid(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return t.take((f"midlayer.{name}", f"layers.0.{name}"), shape)

    p: Flat = {
        "fc": _f32(t.take("fc.weight", (d, nf * d)), True),
        "norm_emb": _f32(mid("input_layernorm.weight", (d,))),
        "norm_feat": _f32(mid("hidden_norm.weight", (d,))),
        "mlp_norm": _f32(mid("post_attention_layernorm.weight", (d,))),
        "wq": _f32(mid("self_attn.q_proj.weight", (h * hd, 2 * d)), True),
        "wk": _f32(mid("self_attn.k_proj.weight", (kv * hd, 2 * d)), True),
        "wv": _f32(mid("self_attn.v_proj.weight", (kv * hd, 2 * d)), True),
        "wo": _f32(mid("self_attn.o_proj.weight", (d, h * hd)), True),
        "w_gate": _f32(mid("mlp.gate_proj.weight", (ffn, d)), True),
        "w_up": _f32(mid("mlp.up_proj.weight", (ffn, d)), True),
        "w_down": _f32(mid("mlp.down_proj.weight", (d, ffn)), True),
        "final_norm": _f32(t.take("norm.weight", (d,))),
    }
    head = _f32(t.take("lm_head.weight", (vd, d)))
    embed = t.take("embed_tokens.weight", (v, d), required=False)
    vocab = _vocab(t, vd, v, str(path))
    t.finish()
    p.update(_defaults_and_extra(p, extra, nf, d, str(path)))
    dcfg = DrafterConfig(kind="eagle3", hidden_size=d, num_heads=h, num_kv_heads=kv,
                         head_dim=hd, ffn_size=ffn, num_layers=1, feature_layers=layers,
                         draft_vocab=vd, target_vocab=v, rope_theta=theta, rms_eps=eps,
                         block=js["block"] or 1, target=js["target"], vat=js["vat"],
                         q_temperature=js["q_temperature"],
                         feature_norm=js["feature_norm"], rope_scaling=scaling,
                         norm_before_residual=nbr)
    return dcfg, p, vocab, None if embed is None else _f32(embed), head


def _default_dflash_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The release's `build_target_layer_ids`: 0-indexed layer outputs spread over 1..L-3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(round(start + i * (end - start) / (num_draft_layers - 1))  # Python's round
                 for i in range(num_draft_layers))


def _read_dflash(path: Path, cfg: dict[str, Any], target_config: Any
                 ) -> tuple[DrafterConfig, Flat, np.ndarray, Any, Any]:
    f = _Fields(cfg, str(path / "config.json"), IGNORED)
    f.get("architectures", list)
    f.expect("model_type", ("qwen3", "llama"), "DFlash drafters are Qwen3-style layers")
    d = f.get("hidden_size", int, required=True)
    v = f.get("vocab_size", int, required=True)
    ffn = f.get("intermediate_size", int, required=True)
    h = f.get("num_attention_heads", int, required=True)
    kv = f.get("num_key_value_heads", int, h)
    hd = f.get("head_dim", int, required=True)  # Qwen3Config's default (128) is not d // h
    n_layers = f.get("num_hidden_layers", int, required=True)
    eps = f.get("rms_norm_eps", float, 1e-6)
    theta, scaling = _rope(f, hd)
    f.expect("hidden_act", ("silu",))
    f.expect("attention_bias", (False,))
    f.expect("is_causal", (False,), "DFlash attends bidirectionally within the block")
    f.expect("logit_scale", (1, 1.0))
    _no_sliding_window(f)
    ntl = f.get("num_target_layers", int)
    if ntl is not None and ntl != target_config.num_layers:
        raise JspecError(f"{f.where}: num_target_layers = {ntl}, the target has "
                         f"{target_config.num_layers} layers")
    dc = _Fields(f.get("dflash_config", dict, {}), f"{f.where}: dflash_config")
    mask_id = dc.get("mask_token_id", int)
    ids = dc.get("target_layer_ids", list)
    block = dc.get("block_size", int, f.get("block_size", int, 16))
    for key, ok in (("use_swa", (False,)), ("causal", (False,)),
                    ("attention_sink_bias", (False,)), ("input_embedding_scale", (1, 1.0)),
                    ("output_multiplier", (1, 1.0)), ("final_logit_softcapping", (0, 0.0)),
                    ("use_aux_hidden_state", (True,))):
        dc.expect(key, ok)
    dc.finish()
    if ids is None:
        if ntl is None:
            raise JspecError(f"{f.where}: missing dflash_config.target_layer_ids (and no "
                             "num_target_layers to derive them from)")
        ids = list(_default_dflash_layers(ntl, n_layers))
    layers = tuple(int(i) + 1 for i in ids)
    vd = f.get("draft_vocab_size", int, v)
    js, extra = _jspec_section(f, path)
    f.finish()
    block_input = js["block_input"] or "tokens"
    qk_norm = True if js["qk_norm"] is None else js["qk_norm"]
    if block_input == "tokens" and mask_id is None:
        raise JspecError(f"{f.where}: missing required field dflash_config.mask_token_id")
    if (path / "mask_embedding.pt").exists():
        raise JspecError(f"{path}: a separate mask_embedding.pt is not supported")
    nf = len(layers)
    t = _Tensors(_read_dir_tensors(path), str(path))
    p: Flat = {"fc": _f32(t.take("fc.weight", (d, nf * d)), True),
                 "fc_norm": _f32(t.take("hidden_norm.weight", (d,))),
                 "final_norm": _f32(t.take("norm.weight", (d,)))}
    for i in range(n_layers):
        pre = f"layers.{i}."
        p[f"l{i}.attn_norm"] = _f32(t.take(pre + "input_layernorm.weight", (d,)))
        p[f"l{i}.mlp_norm"] = _f32(t.take(pre + "post_attention_layernorm.weight", (d,)))
        p[f"l{i}.wq"] = _f32(t.take(pre + "self_attn.q_proj.weight", (h * hd, d)), True)
        p[f"l{i}.wk"] = _f32(t.take(pre + "self_attn.k_proj.weight", (kv * hd, d)), True)
        p[f"l{i}.wv"] = _f32(t.take(pre + "self_attn.v_proj.weight", (kv * hd, d)), True)
        p[f"l{i}.wo"] = _f32(t.take(pre + "self_attn.o_proj.weight", (d, h * hd)), True)
        p[f"l{i}.w_gate"] = _f32(t.take(pre + "mlp.gate_proj.weight", (ffn, d)), True)
        p[f"l{i}.w_up"] = _f32(t.take(pre + "mlp.up_proj.weight", (ffn, d)), True)
        p[f"l{i}.w_down"] = _f32(t.take(pre + "mlp.down_proj.weight", (d, ffn)), True)
        if qk_norm:
            p[f"l{i}.q_norm"] = _f32(t.take(pre + "self_attn.q_norm.weight", (hd,)))
            p[f"l{i}.k_norm"] = _f32(t.take(pre + "self_attn.k_norm.weight", (hd,)))
    head = t.take("lm_head.weight", (vd, d), required=False)
    embed = t.take("embed_tokens.weight", (v, d), required=False)
    vocab = _vocab(t, vd, v, str(path))
    if head is None and vd != v:
        raise JspecError(f"{path}: draft_vocab_size {vd} without an lm_head.weight")
    t.finish()
    p.update(_defaults_and_extra(p, extra, nf, d, str(path)))
    dcfg = DrafterConfig(kind="dflash", hidden_size=d, num_heads=h, num_kv_heads=kv,
                         head_dim=hd, ffn_size=ffn, num_layers=n_layers, feature_layers=layers,
                         draft_vocab=vd, target_vocab=v, rope_theta=theta, rms_eps=eps,
                         block=block, target=js["target"], vat=js["vat"],
                         q_temperature=js["q_temperature"],
                         feature_norm=js["feature_norm"], rope_scaling=scaling,
                         qk_norm=qk_norm, block_input=block_input,
                         mask_token_id=-1 if mask_id is None else mask_id)
    return (dcfg, p, vocab, None if embed is None else _f32(embed),
            None if head is None else _f32(head))


def _defaults_and_extra(p: Flat, extra: dict[str, np.ndarray], nf: int, d: int,
                        where: str) -> Flat:
    """jspec's own parameters: identity standardisation and a silent VAT head unless the
    export's extra tensors give them."""
    out: Flat = {"feat_mean": jnp.zeros((nf, d), jnp.float32),
                   "feat_std": jnp.ones((nf, d), jnp.float32),
                   "vh_w": jnp.zeros((d,), jnp.float32), "vh_b": jnp.zeros((1,), jnp.float32)}
    for k, a in extra.items():
        if k in p:
            raise JspecError(f"{where}: {EXTRA_FILE} repeats the parameter {k}")
        if k in out and tuple(a.shape) != tuple(out[k].shape):
            raise JspecError(f"{where}: {EXTRA_FILE}: {k} has shape {tuple(a.shape)}, expected "
                             f"{tuple(out[k].shape)}")
        out[k] = _f32(a)
    return out


# Each community format's reader: (path, its config.json, the target's config) ->
# (DrafterConfig, flat parameters, vocabulary, own embedding or None, own head or None).
READERS: dict[str, Callable[..., tuple[Any, ...]]] = {"eagle3": _read_eagle3,
                                                       "dflash": _read_dflash}


def load_checkpoint(path: str | Path, target: Any = None, *, name: str | None = None,
                    cut: float = 0.0) -> Any:
    """A jspec `Eagle3` / `DFlash` drafter from a community (or exported) checkpoint directory.

    Args:
      path: the directory (config.json + safetensors).
      target: the loaded target Model; may be omitted for a jspec export naming its target.
      cut: VAT cut (only exports of jspec drafters with a trained verification head have one).
    Returns:
      the drafter, its config's `feature_norm` telling the decoder whether to normalise.
    """
    path = Path(path)
    cfg_path = path / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise JspecError(f"cannot read {cfg_path}: {e}") from e
    kind = _architecture(cfg, str(cfg_path)) if isinstance(cfg, dict) else None
    if kind is None:
        raise JspecError(f"{cfg_path}: not an EAGLE-3 ({', '.join(EAGLE3_ARCHS)}) or DFlash "
                         f"({', '.join(DFLASH_ARCHS)}) checkpoint")
    if target is None:
        named = (cfg.get("jspec") or {}).get("target") if isinstance(cfg.get("jspec"), dict) \
            else None
        if not named:
            raise JspecError(f"{path} does not name a target jspec can load: pass target=")
        target = load_model(named)
    dcfg, params, vocab, embed, head = READERS[kind](path, cfg, target.config)
    check_target(dcfg, target.config)
    if dcfg.feature_norm == "none" and max(dcfg.feature_layers) >= target.config.num_layers:
        raise JspecError(f"{cfg_path}: reads target layer {max(dcfg.feature_layers)} (HF "
                         "hidden_states index), the target's last: HF's is after the final "
                         "norm, jspec's is not")
    if not 0.0 <= cut < 1.0:
        raise JspecError(f"cut must be in [0, 1), got {cut}")
    entry = kinds.by_checkpoint(kind)
    d = entry.make(dcfg, from_flat(entry.name, params), vocab, target.weights, cut=cut,
                   name=name or str(path))
    repl: dict[str, Any] = {}
    if head is not None:
        repl.update(head=head, own_head=True)
    if embed is not None:
        repl.update(embed=embed, own_embed=True)
    return dataclasses.replace(d, **repl) if repl else d


