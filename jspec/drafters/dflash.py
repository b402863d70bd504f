"""DFlash-style block-diffusion drafter.

Target features from layers spread over the network are concatenated, projected (`fc` + RMSNorm)
into a context sequence whose keys/values (each drafter layer's own k/v projections, RoPE at the
context position) are prepended to every drafter layer's attention. The input block is
[anchor, MASK x (γ-1)] at positions a..a+γ-1, attending bidirectionally inside the block and to
the context before a; one forward pass proposes γ-1 tokens. Confidences are each slot's maximum
softmax probability, fixed before its token is drawn (exposed in the state for LibraSpec / D²SD).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters.base import DraftContext
from jspec.drafters.trained import (
    DFlashParams,
    DrafterConfig,
    Pending,
    TrainedDrafter,
    choose,
    draft_logits,
    heads_first,
    in_config_order,
    init_dense,
    init_layer,
    rot,
    shared_inputs,
    standardize,
    verify_head,
)
from jspec.models import blocks
from jspec.models.blocks import apply_rope, dense, rms_norm, rms_normalize
from jspec.models.cache import KV_AXES, write_slots
from jspec.sampling import Sampling
from jspec.sharding import logical


def init_params(cfg: DrafterConfig, key: jax.Array) -> DFlashParams:
    d, f = cfg.hidden_size, len(cfg.feature_layers)
    ks = jax.random.split(key, cfg.num_layers + 2)
    return DFlashParams(
        feat_mean=jnp.zeros((f, d), jnp.float32), feat_std=jnp.ones((f, d), jnp.float32),
        fc=init_dense(ks[0], f * d, d), fc_norm=jnp.ones((d,), jnp.float32),
        mask_emb=0.02 * jax.random.normal(ks[1], (d,), jnp.float32),
        # Unit-scale slot embeddings: with 0.02 the slots start out indistinguishable and the
        # 7-position loss held every slot at the unigram solution (acc@1 ~0.1 after 100 steps
        # vs ~0.25 after 60 with this; a 1-slot block learns at EAGLE's pace either way).
        slot_emb=1.0 * jax.random.normal(jax.random.fold_in(ks[1], 1), (cfg.block, d),
                                         jnp.float32),
        final_norm=jnp.ones((d,), jnp.float32),
        vh_w=jnp.zeros((d,), jnp.float32), vh_b=jnp.zeros((1,), jnp.float32),
        layers=tuple(init_layer(ks[i + 2], cfg, d, attn_norm=True)
                     for i in range(cfg.num_layers)))


def context(cfg: DrafterConfig, p: DFlashParams, feats: jax.Array) -> jax.Array:
    """c f32[B, T, D] = RMSNorm(fc(concat features)) from f32[B, T, F, D]."""
    b, t, f, d = feats.shape
    z = standardize(p, feats).reshape(b, t, f * d)
    return rms_norm(dense(z, p.fc), p.fc_norm, cfg.rms_eps)


def context_kv(cfg: DrafterConfig, p: DFlashParams, c: jax.Array, positions: jax.Array
               ) -> list[tuple[jax.Array, jax.Array]]:
    """Per layer (k [B, T, KV, hd] RoPE'd at `positions`, v) of the context: each layer's
    k/v projections (and k norm) of c, not normed by the layer's input norm."""
    b, t, _ = c.shape
    cos, sin = rot(cfg, positions)
    out = []
    for lw in p.layers:
        k = dense(c, lw.wk).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = dense(c, lw.wv).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if lw.k_norm is not None:
            k = rms_norm(k, lw.k_norm, cfg.rms_eps)
        out.append((apply_rope(k, cos, sin), v))
    return out


def block_forward(cfg: DrafterConfig, p: DFlashParams, x: jax.Array, positions: jax.Array,
                  ctx_kv: list[tuple[jax.Array, jax.Array]], ctx_mask: jax.Array,
                  block_mask: jax.Array) -> jax.Array:
    """Drafter layers (the target's `blocks.qkv` / `attention` / `mlp`) over block tokens.

    Args:
      x: f32[B, T, D] block input embeddings; positions: i32[B, T].
      ctx_kv: per layer context (k, v) head-major [B, KV, S, hd]; ctx_mask: bool[B, T, S].
      block_mask: bool[B, T, T] (which block tokens see which: same block).
    Returns:
      f32[B, T, D] hidden states (before the final norm).
    """
    mask = jnp.concatenate([ctx_mask, block_mask], axis=2)
    angles = rot(cfg, positions)
    b, t, _ = x.shape
    for lw, (ck, cv) in zip(p.layers, ctx_kv, strict=True):
        q, k, v = blocks.qkv(cfg.heads, lw, rms_norm(x, lw.attn_norm, cfg.rms_eps), angles)
        o = blocks.attention(q, jnp.concatenate([ck, heads_first(k)], axis=2),
                             jnp.concatenate([cv, heads_first(v)], axis=2), mask)
        x = x + dense(o.reshape(b, t, -1), lw.wo)
        x = blocks.mlp(lw, x, cfg.rms_eps)
    return x


def block_inputs(p: DFlashParams, embed: jax.Array, anchors: jax.Array, gamma: int,
                 last_c: jax.Array) -> jax.Array:
    """f32[B, M*γ, D]: per anchor, [emb(anchor), MASK_1 .. MASK_{γ-1}]. anchors: i32[B, M];
    last_c: f32[B, M, D] the projected context feature just before each anchor.

    jspec choice: MASK_k = mask_emb + slot_emb[k] + RMS-normalised emb(anchor), so every slot
    sees the anchor directly instead of having to find it among hundreds of context keys
    first; it adds no information the block did not have (the anchor is its first token) and
    learns faster on a small training budget. Likewise every slot gets the context feature of
    the position just before the anchor (the target's state that predicted the anchor), which
    attention would otherwise have to learn to pick out by its relative position.
    """
    b, m = anchors.shape
    a = rms_normalize(blocks.embed_rows(embed, anchors))[:, :, None] + last_c[:, :, None]
    slots = p.mask_emb + p.slot_emb[1:gamma]  # [γ-1, D]
    msk = a + slots[None, None]
    return jnp.concatenate([a, msk], axis=2).reshape(b, m * gamma, -1)


def token_block_inputs(embed: jax.Array, anchors: jax.Array, gamma: int, mask_id: int
                       ) -> jax.Array:
    """f32[B, M*γ, D]: the DFlash release's block input, the target's embeddings of
    [anchor, MASK x (γ-1)] per anchor (`block_input="tokens"`). anchors: i32[B, M]."""
    b, m = anchors.shape
    toks = jnp.concatenate([anchors[:, :, None],
                            jnp.full((b, m, gamma - 1), mask_id, anchors.dtype)], axis=2)
    return blocks.embed_rows(embed, toks.reshape(b, m * gamma), jnp.float32)


def make_block_inputs(cfg: DrafterConfig, p: DFlashParams, embed: jax.Array, anchors: jax.Array,
                      gamma: int, last_c: jax.Array) -> jax.Array:
    """f32[B, M*γ, D] block inputs in the drafter's variant (`cfg.block_input`)."""
    if cfg.block_input == "tokens":
        return token_block_inputs(embed, anchors, gamma, cfg.mask_token_id)
    return block_inputs(p, embed, anchors, gamma, last_c)


def train_forward(cfg: DrafterConfig, p: DFlashParams, embed: jax.Array, tokens: jax.Array,
                  feats: jax.Array, anchors: jax.Array, gamma: int) -> jax.Array:
    """Many blocks per sequence in one pass.

    Args:
      tokens: i32[B, S]; feats: f32[B, S, F, D]; anchors: i32[B, M] anchor positions.
    Returns:
      f32[B, M, γ, D] block hidden states; [:, m, k] predicts token anchors[m] + k (k >= 1).
    """
    c, ctx_kv = train_context(cfg, p, feats)
    a_tok = jnp.take_along_axis(tokens, anchors, axis=1)
    last_c = jnp.take_along_axis(c, jnp.maximum(anchors - 1, 0)[..., None], axis=1)
    x = make_block_inputs(cfg, p, embed, a_tok, gamma, last_c)
    return train_blocks(cfg, p, x, anchors, ctx_kv, gamma)


def train_context(cfg: DrafterConfig, p: DFlashParams, feats: jax.Array
                  ) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
    """Projected context c f32[B, S, D] of a training sequence and its per-layer (k, v)
    head-major [B, KV, S, hd]."""
    b, s = feats.shape[:2]
    c = context(cfg, p, feats)
    pos_s = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    return c, [(heads_first(k), heads_first(v)) for k, v in context_kv(cfg, p, c, pos_s)]


def train_blocks(cfg: DrafterConfig, p: DFlashParams, x: jax.Array, anchors: jax.Array,
                 ctx_kv: list[tuple[jax.Array, jax.Array]], gamma: int) -> jax.Array:
    """M blocks per sequence in one pass: x f32[B, M*γ, D] block inputs at anchors i32[B, M],
    each block attending to the context before its anchor and bidirectionally within itself.
    Returns f32[B, M, γ, D]."""
    b, m = anchors.shape
    s = ctx_kv[0][0].shape[2]
    pos_s = jnp.arange(s, dtype=jnp.int32)
    qpos = (anchors[:, :, None] + jnp.arange(gamma)[None, None]).reshape(b, m * gamma)
    qa = jnp.repeat(anchors, gamma, axis=1)  # [B, M*γ] anchor of each query
    ctx_mask = pos_s[None, None, :] < qa[:, :, None]
    blk = jnp.repeat(jnp.arange(m), gamma)
    block_mask = jnp.broadcast_to(blk[:, None] == blk[None, :], (b, m * gamma, m * gamma))
    h = block_forward(cfg, p, x, qpos, ctx_kv, ctx_mask, block_mask)
    return h.reshape(b, m, gamma, -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DFlashState:
    ck: tuple[jax.Array, ...] = logical(*KV_AXES)  # per layer f32[B, KV, C, hd]: context keys
    cv: tuple[jax.Array, ...] = logical(*KV_AXES)  # (slot = position)
    pending: Pending
    conf: jax.Array  # f32[B, K] confidences (each slot's max probability) of the last proposal
    vhat: jax.Array  # f32[B, K] verification-head probabilities
    last_c: jax.Array  # f32[B, D] projected context feature at position cache_len - 1
    hidden: jax.Array  # f32[B, K, D] hidden states that produced the last proposal (DIVERSED)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFlash(TrainedDrafter):
    """The DFlash drafter as a jspec drafter: k <= block-1 tokens in one pass, more in chained
    blocks."""

    params: DFlashParams
    embed: jax.Array = logical("vocab", "embed")  # [V, D] the target's embedding (shared)
    head: jax.Array = logical("vocab", "embed")  # [Vd, D]
    vocab_ids: jax.Array = logical(None)  # i32[Vd]
    cfg: DrafterConfig = dataclasses.field(metadata=dict(static=True))
    cut: float = dataclasses.field(metadata=dict(static=True), default=0.0)
    name: str = dataclasses.field(metadata=dict(static=True), default="dflash")
    # An imported checkpoint's own LM head / embedding (not the target's): `bind` keeps them.
    own_head: bool = dataclasses.field(metadata=dict(static=True), default=False)
    own_embed: bool = dataclasses.field(metadata=dict(static=True), default=False)
    default_k: int = dataclasses.field(metadata=dict(static=True), default=5)
    max_batch: int | None = dataclasses.field(metadata=dict(static=True), default=None)

    def _write(self, ck, cv, feats, positions):
        """Context K/V of feats f32[B, T, F, D] written at consecutive positions i32[B, T]."""
        c = context(self.cfg, self.params, feats)
        kv = context_kv(self.cfg, self.params, c, positions)
        ck = tuple(write_slots(a, k, positions[:, 0]) for a, (k, _) in zip(ck, kv, strict=True))
        cv = tuple(write_slots(a, v, positions[:, 0]) for a, (_, v) in zip(cv, kv, strict=True))
        return ck, cv, c

    @property
    def block_tokens(self) -> int:
        """Tokens one block forward proposes (γ-1); LibraSpec extends by blocks of this size."""
        return self.cfg.block - 1

    def init_state(self, features: jax.Array, prompt_ids: jax.Array, prompt_lengths: jax.Array,
                   capacity: int, *, k: int, verify_width: int | None = None) -> DFlashState:
        """`k`: tokens per `propose`; `verify_width`: most drafted tokens a verify pass scores
        (default k; larger under LibraSpec, whose extra blocks come from `extend`)."""
        b, p = prompt_ids.shape
        cfg = self.cfg
        features = in_config_order(cfg, features)
        z = jnp.zeros((b, cfg.num_kv_heads, capacity, cfg.head_dim), jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        ck, cv, c = self._write((z,) * cfg.num_layers, (z,) * cfg.num_layers, features, pos)
        pend = jnp.zeros((b, (verify_width or k) + 1, *features.shape[2:]), jnp.float32)
        zk = jnp.zeros((b, k), jnp.float32)
        last_c = jnp.take_along_axis(c, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
        return DFlashState(ck=ck, cv=cv, pending=Pending(pend, prompt_lengths,
                                                         jnp.zeros((b,), jnp.int32)),
                           conf=zk, vhat=zk, last_c=last_c,
                           hidden=jnp.zeros((b, k, cfg.hidden_size), jnp.float32))

    def propose(self, state: DFlashState, ctx: DraftContext, k: int, sampling: Sampling,
                key: jax.Array) -> tuple[jax.Array, jax.Array | None, DFlashState]:
        """k <= γ-1 tokens in one block forward; a longer k chains ⌈k/(γ-1)⌉ blocks, each
        anchored on the previous block's last token (see `extend`)."""
        p = self.params
        pend = state.pending
        ck, cv, last_c = self.ingest(state)
        bs = self.block_tokens
        n_blocks = -(-k // bs)
        keys = jax.random.split(key, n_blocks)
        parts = []
        anchor = ctx.last
        for j in range(n_blocks):
            part = self._block(ck, cv, last_c, anchor, ctx.cache_len + j * bs, ctx.cache_len,
                               min(k, bs), sampling, keys[j])
            parts.append(part)
            anchor = part[1][:, -1]
        h, tokens, q, conf = (jnp.concatenate(xs, axis=1)[:, :k] if xs[0] is not None else None
                              for xs in zip(*parts, strict=True))
        vhat = jax.nn.sigmoid(verify_head(p, h))
        if self.cut > 0:
            tokens = jnp.where(jnp.cumsum(vhat < self.cut, axis=1) > 0, -1, tokens)
        return tokens, q, DFlashState(ck=ck, cv=cv, pending=pend, conf=conf, vhat=vhat,
                                      last_c=last_c, hidden=h.astype(jnp.float32))

    def ingest(self, state: DFlashState
               ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], jax.Array]:
        """Write the pending target features into the context K/V; returns (ck, cv, last_c
        f32[B, D] the projected feature just before the next anchor)."""
        pend = state.pending
        m = pend.feats.shape[1]
        pos = pend.start[:, None] + jnp.arange(m, dtype=jnp.int32)[None]
        ck, cv, c = self._write(state.ck, state.cv, pend.feats, pos)
        new_c = jnp.take_along_axis(c, jnp.maximum(pend.count - 1, 0)[:, None, None], axis=1)
        last_c = jnp.where(pend.count[:, None] > 0, new_c[:, 0], state.last_c)
        return ck, cv, last_c

    def _block(self, ck: tuple[jax.Array, ...], cv: tuple[jax.Array, ...], last_c: jax.Array,
               anchor: jax.Array, anchor_pos: jax.Array, ctx_len: jax.Array, k: int,
               sampling: Sampling, key: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array]:
        """One block forward: [anchor, MASK x k] at anchor_pos.. attending to context slots
        < ctx_len. Returns (hidden f32[B, k, D], tokens i32[B, k], q, conf f32[B, k])."""
        cfg, p = self.cfg, self.params
        b = anchor.shape[0]
        gamma = k + 1
        x = make_block_inputs(cfg, p, self.embed, anchor[:, None], gamma,
                              last_c[:, None])  # [B, γ, D]
        qpos = anchor_pos[:, None] + jnp.arange(gamma, dtype=jnp.int32)[None]
        slots = jnp.arange(ck[0].shape[2], dtype=jnp.int32)
        ctx_mask = jnp.broadcast_to(slots[None, None, :] < ctx_len[:, None, None],
                                    (b, gamma, slots.shape[0]))
        h = block_forward(cfg, p, x, qpos, list(zip(ck, cv, strict=True)), ctx_mask,
                          jnp.ones((b, gamma, gamma), bool))
        h = h[:, 1:]  # [B, k, D]
        tokens, q, conf = choose(draft_logits(cfg, p, self.head, h), self.vocab_ids, sampling,
                                 key, cfg.q_temperature)
        return h, tokens, q, conf

    def extend(self, state: DFlashState, ctx: DraftContext, anchor: jax.Array,
               offset: jax.Array | int, sampling: Sampling, key: jax.Array
               ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """Draft one more block after `propose`, anchored on an already drafted token.

        Args:
          state: the state `propose` returned this round (context written up to cache_len).
          anchor: i32[B] the last drafted token so far; offset: its distance from `last`
            (the block's anchor sits at position cache_len + offset).
        Returns:
          (tokens i32[B, γ-1], q f32[B, γ-1, V] | None, conf f32[B, γ-1]).
        The target has not scored the drafted tokens between `last` and the anchor, so the
        block sees the target context only up to cache_len (jspec's choice for extending a
        block drafter; DFlash was trained with the context ending at the anchor, which is why
        these blocks are weaker and their confidences are what LibraSpec weighs).
        """
        pos = ctx.cache_len + offset
        _, tokens, q, conf = self._block(state.ck, state.cv, state.last_c, anchor, pos,
                                         ctx.cache_len, self.block_tokens, sampling, key)
        return tokens, q, conf


def make(cfg: DrafterConfig, params: DFlashParams, vocab_ids: Any, target_weights: Any,
         cut: float = 0.0, name: str = "dflash") -> DFlash:
    return DFlash(**shared_inputs(vocab_ids, target_weights, params), cfg=cfg, cut=cut,
                 name=name)
