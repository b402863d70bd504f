"""EAGLE-3-style drafter: one decoder layer over fused low/mid/high target features.

Entry s of the drafter pairs the target's features at position s (fused by `fc` from three
layers) with the embedding of token s+1; its output hidden state predicts token s+2. Drafting
chains on its own outputs: step j feeds its previous hidden state in place of the features
(training-time test trains exactly that, `train_forward`). Own KV cache, slot = position.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters.base import Capabilities, DraftContext
from jspec.drafters.topk_tree import expand_tree
from jspec.drafters.trained import (
    DrafterConfig,
    Eagle3Params,
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
from jspec.models.blocks import dense, rms_norm
from jspec.models.cache import KV_AXES
from jspec.sampling import Sampling, process_logits
from jspec.sharding import logical


def init_params(cfg: DrafterConfig, key: jax.Array) -> Eagle3Params:
    d, f = cfg.hidden_size, len(cfg.feature_layers)
    k1, k2 = jax.random.split(key)
    def ones() -> jax.Array:  # one buffer per parameter (training donates them)
        return jnp.ones((d,), jnp.float32)

    return Eagle3Params(feat_mean=jnp.zeros((f, d), jnp.float32),
                        feat_std=jnp.ones((f, d), jnp.float32), fc=init_dense(k1, f * d, d),
                        norm_emb=ones(), norm_feat=ones(), final_norm=ones(),
                        vh_w=jnp.zeros((d,), jnp.float32), vh_b=jnp.zeros((1,), jnp.float32),
                        layer=init_layer(k2, cfg, 2 * d, attn_norm=False))


def fuse(p: Eagle3Params, feats: jax.Array) -> jax.Array:
    """g f32[B, T, D] from rms-normalised features f32[B, T, F, D]."""
    b, t, f, d = feats.shape
    return dense(standardize(p, feats).reshape(b, t, f * d), p.fc)


def _layer_in(cfg: DrafterConfig, p: Eagle3Params, emb: jax.Array, g: jax.Array) -> jax.Array:
    return jnp.concatenate([rms_norm(emb, p.norm_emb, cfg.rms_eps),
                            rms_norm(g, p.norm_feat, cfg.rms_eps)], axis=-1)  # [B, T, 2D]


def _residual(cfg: DrafterConfig, p: Eagle3Params, g: jax.Array) -> jax.Array:
    """The attention block's residual: g, or hidden_norm(g) with `norm_before_residual` (a
    vLLM option of EAGLE-3 checkpoints)."""
    return rms_norm(g, p.norm_feat, cfg.rms_eps) if cfg.norm_before_residual else g


def step(cfg: DrafterConfig, p: Eagle3Params, emb: jax.Array, g: jax.Array,
         positions: jax.Array, ck: jax.Array, cv: jax.Array, *,
         slots: jax.Array | None = None, mask: jax.Array | None = None
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One cached pass over T entries at positions i32[B, T]. emb, g: [B, T, D]; ck, cv
    f32[B, KV, C, hd].

    The target's decoder layer (`blocks.layer`): writes the entries' K/V at slots
    `slots[b] + t` and attends to the slots `mask` bool[B, T, C] allows. Defaults: a chain,
    slot = position (slots = positions[:, 0]) and every slot <= own position visible.
    Returns (h f32[B, T, D], ck, cv).
    """
    if mask is None:
        c = jnp.arange(ck.shape[2], dtype=jnp.int32)
        mask = c[None, None, :] <= positions[:, :, None]
    at = blocks.Attend(pallas_on=frozenset(), mask=mask,
                       lengths=positions[:, 0] if slots is None else slots)
    h, ck, cv, _ = blocks.layer(cfg.heads, p.layer, g, rot(cfg, positions), at, ck, cv,
                                y=_layer_in(cfg, p, emb, g), residual=_residual(cfg, p, g))
    return h, ck, cv


def train_forward(cfg: DrafterConfig, p: Eagle3Params, embed: jax.Array, tokens: jax.Array,
                  feats: jax.Array, steps: int) -> list[jax.Array]:
    """Training-time test over whole sequences, all chains in parallel.

    Args:
      embed: the target's embedding [V, D] (frozen).
      tokens: i32[B, S]; feats: f32[B, S, F, D] (rms-normalised target features).
    Returns:
      `steps` hidden states f32[B, S, D]; h_j[:, s] predicts token s + j + 1 (chain started at
      entry s, j = 1..steps), fed its own previous outputs and the true tokens in between.
    """
    b, s = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, steps), jnp.int32)], axis=1)
    g = fuse(p, feats)
    causal = pos[:, :, None] >= pos[:, None, :]  # [B, S, S]
    outs, own_k, own_v = [], [], []
    k1 = v1 = None
    for j in range(1, steps + 1):
        emb = blocks.embed_rows(embed, nxt[:, j - 1: j - 1 + s], jnp.float32)
        q, k, v = blocks.qkv(cfg.heads, p.layer, _layer_in(cfg, p, emb, g),
                             rot(cfg, pos + (j - 1)))
        if j == 1:
            k1, v1 = heads_first(k), heads_first(v)
            o = blocks.attention(q, k1, v1, causal)
        else:  # step j also sees its own earlier steps' entries at the same position
            own_k.append(k)
            own_v.append(v)
            o = blocks.attention(q, k1, v1, causal,
                                 own=(jnp.stack(own_k, axis=2), jnp.stack(own_v, axis=2)))
        x = _residual(cfg, p, g) + dense(o.reshape(b, s, -1), p.layer.wo)
        h = blocks.mlp(p.layer, x, cfg.rms_eps)
        outs.append(h)
        g = h
    return outs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Eagle3State:
    ck: jax.Array = logical(*KV_AXES)  # f32[B, KV, C, hd] the drafter's keys, slot = position
    cv: jax.Array = logical(*KV_AXES)
    pending: Pending
    conf: jax.Array  # f32[B, K] confidences of the last proposal
    vhat: jax.Array  # f32[B, K] verification-head probabilities of the last proposal
    hidden: jax.Array  # f32[B, K, D] hidden states that produced the last proposal (DIVERSED)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3(TrainedDrafter):
    """The EAGLE-3 drafter as a jspec drafter (protocol of jspec.drafters.base).

    `cut` > 0 (VAT, optional): drafts from the first position whose verification-head
    probability falls below `cut` are withdrawn (proposed as -1).
    """

    params: Eagle3Params
    embed: jax.Array = logical("vocab", "embed")  # [V, D] the target's embedding (shared)
    head: jax.Array = logical("vocab", "embed")  # [Vd, D] the target's LM head rows (draft vocab)
    vocab_ids: jax.Array = logical(None)  # i32[Vd]
    cfg: DrafterConfig = dataclasses.field(metadata=dict(static=True))
    cut: float = dataclasses.field(metadata=dict(static=True), default=0.0)
    name: str = dataclasses.field(metadata=dict(static=True), default="eagle3")
    # An imported checkpoint's own LM head / embedding (not the target's): `bind` keeps them.
    own_head: bool = dataclasses.field(metadata=dict(static=True), default=False)
    own_embed: bool = dataclasses.field(metadata=dict(static=True), default=False)
    default_k: int = dataclasses.field(metadata=dict(static=True), default=5)
    max_batch: int | None = dataclasses.field(metadata=dict(static=True), default=None)

    def init_state(self, features: jax.Array, prompt_ids: jax.Array, prompt_lengths: jax.Array,
                   capacity: int, *, k: int, verify_width: int | None = None) -> Eagle3State:
        """Ingest prompt entries 0..len-2; entry len-1 waits for the first sampled token.
        `k`: tokens per `propose`; `verify_width`: the most drafted tokens a round accepts
        (k; more for a proposer whose chains run longer, `INNER+ngram:look=L`)."""
        b, p = prompt_ids.shape
        cfg = self.cfg
        features = in_config_order(cfg, features)
        ck = jnp.zeros((b, cfg.num_kv_heads, capacity, cfg.head_dim), jnp.float32)
        cv = jnp.zeros_like(ck)
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        nxt = jnp.concatenate([prompt_ids[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
        emb = blocks.embed_rows(self.embed, nxt, jnp.float32)
        _, ck, cv = step(cfg, self.params, emb, fuse(self.params, features), pos, ck, cv)
        last = jnp.take_along_axis(features, (prompt_lengths - 1)[:, None, None, None], axis=1)
        pend = jnp.zeros((b, (verify_width or k) + 1, *features.shape[2:]),
                         jnp.float32).at[:, :1].set(last)
        z = jnp.zeros((b, k), jnp.float32)
        return Eagle3State(ck=ck, cv=cv, pending=Pending(pend, prompt_lengths - 1,
                                                         jnp.ones((b,), jnp.int32)),
                           conf=z, vhat=z, hidden=jnp.zeros((b, k, cfg.hidden_size), jnp.float32))

    @property
    def caps(self) -> Capabilities:
        return dataclasses.replace(super().caps, expands=True)

    def _ingest(self, state: Eagle3State, ctx: DraftContext
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The pending target features into the drafter's cache: (h f32[B, 1, D], the hidden
        state that predicts the first drafted token, ck, cv)."""
        cfg, p = self.cfg, self.params
        pend = state.pending
        m = pend.feats.shape[1]
        pos = pend.start[:, None] + jnp.arange(m, dtype=jnp.int32)[None]  # [B, M]
        nxt = jnp.take_along_axis(ctx.seq, jnp.minimum(pos + 1, ctx.seq.shape[1] - 1), axis=1)
        emb = blocks.embed_rows(self.embed, nxt, jnp.float32)
        h, ck, cv = step(cfg, p, emb, fuse(p, pend.feats), pos, state.ck, state.cv)
        return jnp.take_along_axis(h, (pend.count - 1)[:, None, None], axis=1), ck, cv

    def propose(self, state: Eagle3State, ctx: DraftContext, k: int, sampling: Sampling,
                key: jax.Array) -> tuple[jax.Array, jax.Array | None, Eagle3State]:
        cfg, p = self.cfg, self.params
        pend = state.pending
        h, ck, cv = self._ingest(state, ctx)
        p0 = ctx.cache_len - 1  # position of the chain's first entry
        keys = jax.random.split(key, k)
        toks, qs, confs, vh, hs = [], [], [], [], []
        for j in range(k):
            t, q, c = choose(draft_logits(cfg, p, self.head, h), self.vocab_ids, sampling,
                             keys[j], cfg.q_temperature)
            toks.append(t[:, 0])
            qs.append(None if q is None else q[:, 0])
            confs.append(c[:, 0])
            vh.append(jax.nn.sigmoid(verify_head(p, h))[:, 0])
            hs.append(h[:, 0])
            if j + 1 < k:
                emb = blocks.embed_rows(self.embed, t, jnp.float32)
                h, ck, cv = step(cfg, p, emb, h, (p0 + j + 1)[:, None], ck, cv)
        tokens = jnp.stack(toks, axis=1)
        vhat = jnp.stack(vh, axis=1)
        if self.cut > 0:
            tokens = jnp.where(jnp.cumsum(vhat < self.cut, axis=1) > 0, -1, tokens)
        q = None if sampling.greedy else jnp.stack(qs, axis=1)
        return tokens, q, Eagle3State(ck=ck, cv=cv, pending=pend, conf=jnp.stack(confs, 1),
                                      vhat=vhat, hidden=jnp.stack(hs, axis=1))

    def draft_tree(self, state: Eagle3State, ctx: DraftContext, *, depth: int, k: int,
                   width: int, n: int, sampling: Sampling | None = None,
                   key: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array, jax.Array | None, Eagle3State]:
        """An EAGLE-2-style tree of `depth` levels (`topk_tree.expand_tree`): (tokens
        i32[B, n], parents i32[B, n], q f32[B, n, Vd] | None, state). Given `sampling` (T > 0)
        and `key`, children are drawn from q (the distribution `choose` draws a chain from)
        without replacement and q is returned; otherwise the most probable children, q None.

        The W nodes of level l are one `step` at position p0 + l (p0: the first drafted entry's
        parent, as in `propose`) whose entries go to the tree slots past the capacity (the
        state was made with (depth - 1) * width of them); each attends to the committed context
        (slots <= p0) and to its own expanded ancestors, and is fed its parent's hidden state
        as the chain's step is. The drafter's context slots are left as a chain propose leaves
        them: the next ingest overwrites everything past the committed length. A VAT `cut`
        does not apply here (the tree's node budget decides what is verified).
        """
        cfg, p = self.cfg, self.params
        h0, ck, cv = self._ingest(state, ctx)
        b = h0.shape[0]
        cap = ck.shape[2]
        base = cap - (depth - 1) * width  # the first tree slot
        p0 = ctx.cache_len - 1
        context = jnp.arange(base, dtype=jnp.int32)[None, :] <= p0[:, None]  # [B, base]

        drawn = key is not None and sampling is not None and not sampling.greedy

        def logp(h: jax.Array) -> jax.Array:
            z = draft_logits(cfg, p, self.head, h)
            if drawn:  # as `choose` processes the logits it samples a chain from
                z = process_logits(z if cfg.q_temperature == 1.0 else z / cfg.q_temperature,
                                   sampling)
            return jax.nn.log_softmax(z, axis=-1)

        def expand(carry: Any, level: int, tok: jax.Array, parent: jax.Array, anc: jax.Array
                   ) -> tuple[jax.Array, Any]:
            ck, cv, hp = carry
            g = jnp.take_along_axis(hp, parent[..., None], axis=1)  # [B, W, D] parents' states
            emb = blocks.embed_rows(self.embed, tok, jnp.float32)
            pos = jnp.broadcast_to((p0 + level)[:, None], tok.shape)
            mask = jnp.concatenate([jnp.broadcast_to(context[:, None], (b, width, base)), anc],
                                   axis=-1)  # [B, W, cap]
            slots = jnp.full((b,), base + (level - 1) * width, jnp.int32)
            h, ck, cv = step(cfg, p, emb, g, pos, ck, cv, slots=slots, mask=mask)
            return logp(h), (ck, cv, h)

        tokens, parents, q, (ck, cv, _) = expand_tree(
            logp(h0)[:, 0], self.vocab_ids, expand, (ck, cv, h0), depth=depth, k=k, width=width,
            n=n, key=key if drawn else None)
        return tokens, parents, q, dataclasses.replace(state, ck=ck, cv=cv)


def make(cfg: DrafterConfig, params: Eagle3Params, vocab_ids: Any, target_weights: Any,
         cut: float = 0.0, name: str = "eagle3") -> Eagle3:
    return Eagle3(**shared_inputs(vocab_ids, target_weights, params), cfg=cfg, cut=cut,
                 name=name)
