"""Pieces shared by the trained drafters (EAGLE-3, DFlash): config, parameters, layers, I/O.

Both read the target's hidden states ("features") at a few layers. The speculative round asks
the target forward for those layers (`feature_layers`), normalises each by its RMS (late layers
reach |x| ~ 1e5) and hands them to the drafter through `observe`; the drafter ingests them at the
start of its next `propose`. Both share the target's embedding, and their LM head is the target's
(tied) head restricted to a draft vocabulary of the most frequent response tokens (`vocab_ids`):
a draft distribution q is zero outside it, which keeps verification lossless.

Parameters are registered dataclasses (`jspec.drafters.params`: `Eagle3Params`, `DFlashParams`,
re-exported here); files are safetensors of their flat names (`to_flat`: "fc", "wq", "l0.wq",
...) with the config and the draft vocabulary inside (`save_drafter`, `load_drafter_file`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec import safetensors_io
from jspec.drafters.base import Capabilities, ChainDrafter, DraftContext, Proposal
from jspec.drafters.params import (  # noqa: F401 (re-exported: the names files and tests use)
    FROZEN,
    MATRICES,
    PARAMS,
    DFlashParams,
    Eagle3Params,
    Params,
    cast_matrices,
    from_flat,
    split_frozen,
    to_flat,
    with_stats,
)
from jspec.errors import JspecError
from jspec.models.blocks import Heads, LayerWeights, dense, matmul, rms_norm, rope_angles
from jspec.models.config import ModelConfig
from jspec.sampling import Sampling, argmax, categorical, process_logits
from jspec.sharding import logical

FEATURE_NORMS = ("rms", "none")
BLOCK_INPUTS = ("jspec", "tokens")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Static shape of a trained drafter. Hashable (a jit static)."""

    kind: str  # "eagle3" | "dflash"
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    num_layers: int
    feature_layers: tuple[int, ...]  # target layers read (output of layer i)
    draft_vocab: int  # size of the draft vocabulary
    target_vocab: int
    rope_theta: float
    rms_eps: float
    block: int  # DFlash: γ (anchor + γ-1 masks); EAGLE-3: training-time-test steps
    target: str = ""  # name of the target it was trained for
    vat: bool = False  # has a trained verification head
    # Variants of the community checkpoints (jspec.drafters.interop); the defaults are jspec's
    # own drafters.
    feature_norm: str = "rms"  # "rms": each feature divided by its RMS (jspec); "none": raw
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # HF rope_scaling pairs
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (DFlash release, Qwen3)
    norm_before_residual: bool = False  # EAGLE-3: the residual is hidden_norm(g), not g (vLLM)
    block_input: str = "jspec"  # DFlash: "jspec" (block_inputs) | "tokens" ([anchor, MASK...])
    mask_token_id: int = -1  # DFlash block_input="tokens": the MASK token's id
    # At T > 0 the draft distribution is q = softmax(logits / (T * q_temperature)): < 1 sharpens
    # a drafter whose q is broader than the target's p, so that more of sum_v min(p, q) is
    # accepted (fitted on held-out data by `python -m train qtemp`; 1 = as trained). Any q is
    # verified exactly, so this changes how much is accepted, never what is sampled.
    q_temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.feature_norm not in FEATURE_NORMS:
            raise JspecError(f"feature_norm must be one of {FEATURE_NORMS}, got "
                             f"{self.feature_norm!r}")
        if self.block_input not in BLOCK_INPUTS:
            raise JspecError(f"block_input must be one of {BLOCK_INPUTS}, got "
                             f"{self.block_input!r}")
        if not (math.isfinite(self.q_temperature) and self.q_temperature > 0):
            raise JspecError(f"q_temperature must be a positive number, got {self.q_temperature!r}")
        if self.block_input == "tokens" and not 0 <= self.mask_token_id < self.target_vocab:
            raise JspecError(f"block_input='tokens' needs a mask_token_id in [0, "
                             f"{self.target_vocab}), got {self.mask_token_id}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, s: str) -> DrafterConfig:
        d = json.loads(s)
        d["feature_layers"] = tuple(d["feature_layers"])
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = tuple(tuple(kv) for kv in d["rope_scaling"])
        return cls(**d)

    @property
    def heads(self) -> Heads:
        return Heads(self.num_heads, self.num_kv_heads, self.head_dim, self.rms_eps)

    def inv_freq(self) -> np.ndarray:
        hd = self.head_dim
        if self.rope_scaling is not None:  # the target's rule (linear / llama3 scaling)
            return ModelConfig(head_dim=hd, rope_theta=self.rope_theta,
                               rope_scaling=self.rope_scaling).inv_freq()
        return 1.0 / (self.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Frozen:
    """What drafter training holds fixed: the target's embedding, its LM-head rows of the draft
    vocabulary, the target -> draft vocabulary map and the feature statistics."""

    embed: jax.Array = logical("vocab", "embed")  # f32[V, D]
    head: jax.Array = logical("vocab", "embed")  # f32[Vd, D]
    to_draft: jax.Array = logical(None)  # i32[V]: draft index, -1 outside
    stats: dict[str, jax.Array] = dataclasses.field(default_factory=dict)  # FROZEN fields

    @classmethod
    def of(cls, embed: Any, vocab: Any, stats: dict[str, jax.Array]) -> Frozen:
        """From the target's embedding [V, D] (its tied LM head), the draft vocabulary i32[Vd]
        (target ids) and the feature statistics."""
        embed = jnp.asarray(embed, jnp.float32)
        vocab = np.asarray(vocab)
        to_draft = np.full((embed.shape[0],), -1, np.int32)
        to_draft[vocab] = np.arange(len(vocab), dtype=np.int32)
        return cls(embed=embed, head=jnp.take(embed, jnp.asarray(vocab), axis=0),
                   to_draft=jnp.asarray(to_draft), stats=stats)


def forward_layers(layers: tuple[int, ...]) -> tuple[int, ...]:
    """The layers the target forward returns for `layers`: each once, sorted."""
    return tuple(sorted(set(layers)))


def in_config_order(cfg: DrafterConfig, feats: jax.Array) -> jax.Array:
    """f32[B, T, F, D] features in `cfg.feature_layers` order from the target forward's
    f32[B, T, F_u, D] (its sorted unique layers). jspec's own drafters list sorted unique
    layers (no-op); an imported checkpoint may name a layer twice or out of order."""
    fl = forward_layers(cfg.feature_layers)
    if fl == cfg.feature_layers:
        return feats
    return feats[:, :, np.asarray([fl.index(i) for i in cfg.feature_layers])]


def standardize(p: Params, feats: jax.Array) -> jax.Array:
    """Per layer and dimension z-scores of rms-normalised features f32[..., F, D].

    The target's residual stream has a few huge, nearly constant dimensions; without centring,
    every context value shares one large common component, and attention over hundreds of
    context positions adds that constant to every drafted slot (DFlash then stalled at the
    unigram solution: it could not memorise a single batch).
    """
    return (feats - p.feat_mean) / p.feat_std


def rot(cfg: DrafterConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """RoPE angles (`blocks.rope_angles`) of positions i32[B, T] in the drafter's rule."""
    return rope_angles(positions, jnp.asarray(cfg.inv_freq(), jnp.float32))


def heads_first(x: jax.Array) -> jax.Array:
    """[B, T, KV, hd] -> head-major [B, KV, T, hd] (the layout `blocks.attention` reads)."""
    return jnp.swapaxes(x, 1, 2)


def init_dense(key: jax.Array, d_in: int, d_out: int) -> jax.Array:
    return jax.random.normal(key, (d_in, d_out), jnp.float32) * (1.0 / np.sqrt(d_in))


def init_layer(key: jax.Array, cfg: DrafterConfig, d_in: int, attn_norm: bool) -> LayerWeights:
    """One decoder layer whose q/k/v read `d_in` features (`attn_norm`: with its own input
    norm; EAGLE-3 norms its two inputs itself)."""
    ks = jax.random.split(key, 7)
    d, h, kv, hd, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                       cfg.ffn_size)
    return LayerWeights(attn_norm=jnp.ones((d,), jnp.float32) if attn_norm else None,
                        wq=init_dense(ks[0], d_in, h * hd),
                        wk=init_dense(ks[1], d_in, kv * hd),
                        wv=init_dense(ks[2], d_in, kv * hd),
                        wo=init_dense(ks[3], h * hd, d) * 0.5,
                        mlp_norm=jnp.ones((d,), jnp.float32),
                        w_gate=init_dense(ks[4], d, f),
                        w_up=init_dense(ks[5], d, f),
                        w_down=init_dense(ks[6], f, d) * 0.5)


def draft_logits(cfg: DrafterConfig, p: Params, head: jax.Array, h: jax.Array) -> jax.Array:
    """f32[..., Vd] draft-vocabulary logits from drafter hidden states [..., D]: a product
    with the head as stored, [Vd, D], in its dtype (as `head.T` XLA:CPU converted a bfloat16
    head to a float32 copy once per call and read that, twice the bytes, every draft step)."""
    x = rms_norm(h, p.final_norm, cfg.rms_eps)
    return matmul("...d,vd->...v", x.astype(head.dtype), head)


def verify_head(p: Params, h: jax.Array) -> jax.Array:
    """VAT verification head: f32[...] logit of v̂ (sigmoid -> probability of acceptance)."""
    return dense(h, p.vh_w[:, None])[..., 0] + p.vh_b[0]


def choose(logits_d: jax.Array, vocab_ids: jax.Array, sampling: Sampling, key: jax.Array,
           q_temperature: float = 1.0) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Pick draft tokens from draft-vocab logits [B, K, Vd]; at T > 0 sampled from
    softmax(logits / (T * q_temperature)) after the sampling's top-k / top-p (a static float;
    `DrafterConfig.q_temperature`).

    Returns (tokens i32[B, K] in the target vocabulary, q f32[B, K, Vd] over `vocab_ids` (the
    drafter's `q_vocab`) or None when greedy, confidences f32[B, K]: max_v q_k(v), the
    confidence LibraSpec and D²SD read).

    The confidence is the maximum probability of each slot's distribution, not the sampled
    token's own probability: it is fixed before the token is drawn, so a speculation length
    chosen from it never selects on the token it judges (which would bias the output at T > 0;
    ARCHITECTURE "LibraSpec at T > 0"). At T = 0 both are the same number.
    """
    if sampling.greedy:
        idx = argmax(logits_d)
        conf = jnp.max(jax.nn.softmax(logits_d, axis=-1), axis=-1)
        return vocab_ids[idx].astype(jnp.int32), None, conf
    # Processed and sampled in the draft vocabulary: the target-vocabulary logits are NEG
    # outside it, so temperature, top-k (k <= Vd), top-p and softmax give the same q there and
    # 0 elsewhere — without sorting or sampling 49,152 entries per drafted token.
    z = process_logits(logits_d if q_temperature == 1.0 else logits_d / q_temperature, sampling)
    idx = categorical(key, z)
    q_d = jax.nn.softmax(z, axis=-1)
    return vocab_ids[idx].astype(jnp.int32), q_d, jnp.max(q_d, axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pending:
    """Target features of the last verify, not yet ingested by the drafter."""

    feats: jax.Array  # f32[B, M, F, D] rms-normalised features at positions start + m
    start: jax.Array  # i32[B]
    count: jax.Array  # i32[B] valid entries (accepted drafts + 1)


class TrainedDrafter(ChainDrafter):
    """What EAGLE-3, DFlash (and D²SD's drafters) share: a `DrafterConfig` `cfg`, a VAT `cut`,
    target features (`Pending`, ingested at the next propose) and proposals that carry the
    confidences and hidden states their state records (`conf`, `hidden`)."""

    cfg: DrafterConfig
    cut: float

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers the forward is asked for (sorted, unique; `in_config_order`)."""
        return forward_layers(self.cfg.feature_layers)

    @property
    def feature_norm(self) -> str:
        """"rms" (jspec's drafters) or "none" (raw hidden states: imported checkpoints)."""
        return self.cfg.feature_norm

    @property
    def may_abstain(self) -> bool:
        """With a VAT cut a drafter withdraws drafts (-1), possibly all of a round's."""
        return self.cut > 0

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    @property
    def block_tokens(self) -> int:
        """> 0 for block drafters that can `extend` (DFlash)."""
        return 0

    @property
    def q_vocab(self) -> jax.Array:
        """q is over the drafter's own vocabulary (`choose`)."""
        return self.vocab_ids

    @property
    def caps(self) -> Capabilities:
        return Capabilities(feature_layers=self.feature_layers, feature_norm=self.feature_norm,
                            may_abstain=self.may_abstain, block_tokens=self.block_tokens,
                            hidden_size=self.hidden_size)

    def draft(self, state: Any, ctx: DraftContext, k: int, sampling: Sampling,
              key: jax.Array) -> tuple[Proposal, Any]:
        tokens, q, state = self.propose(state, ctx, k, sampling, key)
        return Proposal(tokens=tokens, q=q, q_vocab=self.q_vocab, conf=state.conf,
                        hidden=state.hidden), state

    def observe(self, state: Any, feats: jax.Array, start: jax.Array, count: jax.Array) -> Any:
        """Features f32[B, M, F, D] of the verify block at positions start.., count valid:
        pending until the next propose ingests them."""
        return dataclasses.replace(state, pending=Pending(in_config_order(self.cfg, feats),
                                                          start, count))


def save_drafter(path: str | Path, cfg: DrafterConfig, params: Params, vocab_ids: np.ndarray,
                 dtype: str = "bfloat16", extra_metadata: dict[str, str] | None = None) -> None:
    """safetensors with the config (metadata), the draft vocabulary and the parameters.

    `extra_metadata`: more string entries for the header (D²SD names its first drafter)."""
    out = {"vocab_ids": np.asarray(vocab_ids, np.int32)}
    for k, v in to_flat(params).items():
        a = np.asarray(jnp.asarray(v, jnp.float32))
        if dtype == "bfloat16":  # stored as raw bits (numpy has no bfloat16)
            out["bf16." + k] = np.asarray(jnp.asarray(a, jnp.bfloat16)).view(np.uint16)
        else:
            out[k] = a.astype(dtype)
    safetensors_io.write(path, out, {"jspec_drafter": cfg.to_json(), **(extra_metadata or {})})


def load_drafter_file(path: str | Path) -> tuple[DrafterConfig, Params, np.ndarray]:
    """(config, parameters in float32, draft vocabulary) of a jspec drafter file."""
    path = Path(path)
    try:
        meta, tensors = safetensors_io.read_metadata(path), safetensors_io.read(path)
    except JspecError as e:  # missing, or not safetensors (an unknown dtype says so itself)
        if e.__cause__ is None:
            raise
        raise JspecError(f"cannot read drafter file {path}: {e.__cause__}") from e
    if "jspec_drafter" not in meta:
        raise JspecError(f"{path} is not a jspec drafter file (no config metadata)")
    try:
        cfg = DrafterConfig.from_json(meta["jspec_drafter"])
    except JspecError:
        raise
    except Exception as e:  # a corrupt config
        raise JspecError(f"cannot read drafter file {path}: {e}") from e
    params, vocab = {}, None
    for k, a in tensors.items():
        if k == "vocab_ids":
            vocab = np.array(a)
        elif k.startswith("bf16."):
            params[k[5:]] = jnp.asarray(jnp.asarray(a.view(jnp.bfloat16), jnp.float32))
        else:
            params[k] = jnp.asarray(a, jnp.float32)
    if vocab is None:
        raise JspecError(f"{path} has no vocab_ids")
    try:
        return cfg, from_flat(cfg.kind, params), vocab
    except JspecError as e:
        raise JspecError(f"{path}: {e}") from e


def draft_head(vocab_ids: Any, target_weights: Any) -> jax.Array:
    """The target's LM-head rows [Vd, D] of draft ids (may be traced), in the target's dtype."""
    vocab = jnp.asarray(vocab_ids, jnp.int32)
    embed = target_weights.embed
    return (jnp.take(embed, vocab, axis=0) if target_weights.lm_head is None
            else target_weights.lm_head.T[vocab]).astype(embed.dtype)


def shared_inputs(vocab_ids: Any, target_weights: Any, params: Params) -> dict[str, Any]:
    """What a drafter built for decoding holds besides its config: the target's embedding, its
    LM-head rows of the draft vocabulary, the vocabulary ids, and the drafter's parameters
    with its matrices in the target's dtype (trained in float32; a bfloat16 target drafts
    with bfloat16 matmuls, float32 accumulation; norms, biases and feature statistics stay
    float32)."""
    embed = target_weights.embed
    return {"embed": embed, "head": draft_head(vocab_ids, target_weights),
            "vocab_ids": jnp.asarray(np.asarray(vocab_ids), jnp.int32),
            "params": cast_matrices(params, embed.dtype)}


def param_count(params: Params) -> int:
    return int(sum(np.prod(v.shape) for v in jax.tree.leaves(params)))


def check_target(cfg: DrafterConfig, target_config: Any) -> None:
    """Clear errors when a drafter does not fit the target it is loaded for."""
    if cfg.target_vocab != target_config.vocab_size:
        raise JspecError(f"drafter was trained for a vocabulary of {cfg.target_vocab}, the target "
                         f"has {target_config.vocab_size}")
    if cfg.hidden_size != target_config.hidden_size:
        raise JspecError(f"drafter hidden size {cfg.hidden_size} != target's "
                         f"{target_config.hidden_size}")
    if max(cfg.feature_layers) > target_config.num_layers:
        raise JspecError(f"drafter reads target layer {max(cfg.feature_layers)}, the target has "
                         f"{target_config.num_layers}")

