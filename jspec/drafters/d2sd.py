"""D²SD: dual diffusion drafts in a prefix tree (ALGORITHMS.md §5). The drafting half.

Two DFlash-architecture drafters:
  * the first (the shipped DFlash, referenced by name) drafts the block [anchor, x_1..x_k]
    greedily with confidences c_j = max_v p_j(v);
  * the second, *variable-prefix* drafter reads blocks [anchor, x_1..x_i as known tokens,
    MASK..] and fills the masked slots. It is a fine-tune of the first (`python -m train d2sd`).

Boundary scores r(i) = Π_{j<=i} c_j · (1 - c_{i+1}), i = 0..k-1 (the probability that the
first i drafts are right and x_{i+1} is the first wrong one, under the drafter's own
confidences). The top K = min(branches, k) boundaries (static K) each start a branch: the
second drafter re-drafts from slot i+1 given the first i drafts, all K branches in one batched
block pass over the same target features.

jspec choices (stated, measurable):
  * Both drafters draft greedily at every temperature: the tree walk (jspec/verify/tree.py) only
    matches tokens, it never reads q, so greedy drafts maximise the match probability and
    the output stays exactly the target's distribution.
  * At a branch's first slot the first drafter's token x_{i+1} is excluded (its logit set to
    -inf), so the branch is an alternative to the chain, not a duplicate of it.
  * Each branch keeps its first `branch_len` re-drafted tokens (slots i+1..i+branch_len, at
    most slot k): the tree has T = 1 + k + K·branch_len nodes, a static size. Default 1
    (T = 12 at k = 7): on two held-out HumanEval prompts (48 tokens, k = 7) branch_len 1 / 2 / 3
    gave the same greedy τ (1.62) and τ 1.74 / 1.77 / 1.77 at T=1, while the verify forward
    cost c = t(T nodes)/t(1) rose from ~2.5 (T=12) to ~2.8 (T=20): deeper branch tokens are
    rarely accepted with this drafter, and every node costs verify time. Longer branches are
    an option (`smollm2-135m-d2sd:branch_len=3`) for better second drafters.
  * The second drafter keeps its own context K/V (its fc / k / v projections are fine-tuned
    too); both ingest the same target features, those of the accepted tree path.
  * Known prefix slots are embedded like the anchor: RMS-normalised token embedding + the
    context feature before the anchor, plus the slot embedding. With prefix length 0 the
    block input equals DFlash's, so the fine-tune starts where DFlash is.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jspec.defaults import Settings
from jspec.drafters import dflash
from jspec.drafters.base import Capabilities, DraftContext, Proposal
from jspec.drafters.dflash import (
    DFlash,
    DFlashState,
    block_forward,
    train_blocks,
    train_context,
)
from jspec.drafters.trained import DFlashParams, DrafterConfig, draft_logits
from jspec.errors import JspecError
from jspec.models.blocks import embed_rows, rms_normalize
from jspec.sampling import NEG, Sampling, argmax

META_FIRST = "jspec_d2sd_first"  # safetensors metadata: the first drafter (name or path)


def block_inputs_prefix(p: DFlashParams, embed: jax.Array, block_tokens: jax.Array,
                        prefix_len: jax.Array, last_c: jax.Array) -> jax.Array:
    """f32[B, M*γ, D] block inputs with a known prefix.

    Args:
      block_tokens: i32[B, M, γ]: slot 0 the anchor, slots 1..γ-1 tokens (read only for
        slots <= prefix_len; the rest are masked).
      prefix_len: i32[B, M] in [0, γ-1]: known drafted tokens after the anchor.
      last_c: f32[B, M, D] projected context feature just before each anchor.
    With prefix_len = 0 this is `dflash.block_inputs`.
    """
    b, m, gamma = block_tokens.shape
    e = rms_normalize(embed_rows(embed, block_tokens)) + last_c[:, :, None]  # [B,M,γ,D]
    a = e[:, :, :1]
    slot = p.slot_emb[:gamma]  # [γ, D]
    known = e + slot
    masked = a + (p.mask_emb + slot)
    s = jnp.arange(gamma)[None, None, :, None]
    x = jnp.where(s == 0, a, jnp.where(s <= prefix_len[:, :, None, None], known, masked))
    return x.reshape(b, m * gamma, -1)


def train_forward(cfg: DrafterConfig, p: DFlashParams, embed: jax.Array, tokens: jax.Array,
                  feats: jax.Array, anchors: jax.Array, prefix_len: jax.Array,
                  gamma: int) -> jax.Array:
    """Many variable-prefix blocks per sequence in one pass (training).

    Args:
      tokens: i32[B, S]; feats: f32[B, S, F, D]; anchors: i32[B, M] anchor positions;
      prefix_len: i32[B, M]: block m knows tokens anchors[m] + 1 .. anchors[m] + prefix_len[m].
    Returns:
      f32[B, M, γ, D] block hidden states; [:, m, j] predicts token anchors[m] + j.
    """
    b, s = tokens.shape
    m = anchors.shape[1]
    c, ctx_kv = train_context(cfg, p, feats)
    tpos = jnp.minimum(anchors[..., None] + jnp.arange(gamma)[None, None], s - 1)  # [B, M, γ]
    blk_tok = jnp.take_along_axis(tokens, tpos.reshape(b, m * gamma), axis=1).reshape(b, m, gamma)
    last_c = jnp.take_along_axis(c, jnp.maximum(anchors - 1, 0)[..., None], axis=1)
    x = block_inputs_prefix(p, embed, blk_tok, prefix_len, last_c)
    return train_blocks(cfg, p, x, anchors, ctx_kv, gamma)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class D2SDState:
    first: DFlashState
    second: DFlashState


def tree_layout(k: int, n_branches: int, branch_len: int, bounds: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Parents, depths and validity of the tree for boundaries `bounds` i32[B, K].

    Returns (parents i32[B, T], depth i32[B, T], valid bool[B, T]), T = 1 + k + K·branch_len.
    Branch j's node m (0-based) sits at depth bounds[j] + 1 + m; it is valid while that
    depth is <= k (the second drafter's block ends at slot k).
    """
    b = bounds.shape[0]
    chain_par = jnp.broadcast_to(jnp.arange(-1, k, dtype=jnp.int32), (b, k + 1))
    chain_dep = jnp.broadcast_to(jnp.arange(k + 1, dtype=jnp.int32), (b, k + 1))
    mm = jnp.arange(branch_len, dtype=jnp.int32)[None, None, :]  # [1, 1, L]
    first_node = 1 + k + jnp.arange(n_branches, dtype=jnp.int32)[None, :, None] * branch_len
    node = first_node + mm
    br_par = jnp.where(mm == 0, bounds[:, :, None], node - 1)  # [B, K, L]
    br_dep = bounds[:, :, None] + 1 + mm
    parents = jnp.concatenate([chain_par, br_par.reshape(b, -1)], axis=1)
    depth = jnp.concatenate([chain_dep, br_dep.reshape(b, -1)], axis=1)
    valid = jnp.concatenate([jnp.ones((b, k + 1), bool), (br_dep <= k).reshape(b, -1)], axis=1)
    return parents, depth, valid


def tree_nodes(branches: int, branch_len: int, k: int) -> int:
    """Drafted nodes of a D²SD tree for chain length k: the chain and min(branches, k)
    branches of `branch_len` nodes."""
    return k + min(branches, k) * branch_len


def boundary_scores(conf: jax.Array) -> jax.Array:
    """f32[B, k]: r(i) = Π_{j<=i} c_j · (1 - c_{i+1}) for i = 0..k-1 from conf f32[B, k]
    (conf[:, j] = c_{j+1}, the confidence of drafted token j+1)."""
    before = jnp.cumprod(jnp.concatenate([jnp.ones_like(conf[:, :1]), conf[:, :-1]], axis=1),
                         axis=1)
    return before * (1.0 - conf)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class D2SD:
    """The D²SD tree drafter: proposes trees (`caps.tree`), verified by the tree walk.

    `k` (FixedLength) is the chain length: γ = k + 1 <= the drafters' block.
    """

    first: DFlash
    second: DFlash
    branches: int = dataclasses.field(metadata=dict(static=True), default=4)
    branch_len: int = dataclasses.field(metadata=dict(static=True), default=1)
    name: str = dataclasses.field(metadata=dict(static=True), default="d2sd")
    default_k: int = dataclasses.field(metadata=dict(static=True), default=5)
    max_batch: int | None = dataclasses.field(metadata=dict(static=True), default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.branches, int) or self.branches < 1:
            raise JspecError(f"D2SD branches must be an integer >= 1, got {self.branches!r}")
        if not isinstance(self.branch_len, int) or self.branch_len < 1:
            raise JspecError(f"D2SD branch_len must be an integer >= 1, got {self.branch_len!r}")

    @property
    def cfg(self) -> DrafterConfig:
        """The first drafter's config (both share feature layers, heads and vocabulary)."""
        return self.first.cfg

    @property
    def caps(self) -> Capabilities:
        """A tree drafter reading the first drafter's feature layers; no hidden states."""
        return Capabilities(feature_layers=self.first.feature_layers,
                            feature_norm=self.first.feature_norm, tree=True,
                            nodes=functools.partial(tree_nodes, self.branches, self.branch_len))

    @property
    def settings(self) -> Settings:
        """The measured settings it carries (`default_k`, `max_batch`; `settings_of`)."""
        return Settings(k=self.default_k, max_batch=self.max_batch)

    def num_branches(self, k: int) -> int:
        return min(self.branches, k)

    def tree_size(self, k: int) -> int:
        """T: nodes verified per round (anchor + k chain tokens + the branches)."""
        return 1 + tree_nodes(self.branches, self.branch_len, k)

    def check_k(self, k: int) -> None:
        block = min(self.first.cfg.block, self.second.cfg.block)
        if k + 1 > block:
            raise JspecError(f"D2SD drafters trained with block {block}: k <= {block - 1}, got {k}")

    def init_state(self, features: jax.Array, prompt_ids: jax.Array, prompt_lengths: jax.Array,
                   capacity: int, *, k: int, verify_width: int | None = None) -> D2SDState:
        self.check_k(k)
        return D2SDState(first=self.first.init_state(features, prompt_ids, prompt_lengths,
                                                     capacity, k=k),
                         second=self.second.init_state(features, prompt_ids, prompt_lengths,
                                                       capacity, k=k))

    def observe(self, state: D2SDState, feats: jax.Array, start: jax.Array,
                count: jax.Array) -> D2SDState:
        """feats f32[B, k+1, F, D]: target features of the accepted path (anchor first)."""
        return D2SDState(first=self.first.observe(state.first, feats, start, count),
                         second=self.second.observe(state.second, feats, start, count))

    def draft(self, state: D2SDState, ctx: DraftContext, k: int, sampling: Sampling,
              key: jax.Array) -> tuple[Proposal, D2SDState]:
        """First drafter's chain, boundaries, the K branches in one pass: the tree (greedy
        drafts at every temperature; the tree walk verifies any tree exactly)."""
        self.check_k(k)
        greedy = Sampling()
        with jax.named_scope("draft_chain"):
            chain, _, s1 = self.first.propose(state.first, ctx, k, greedy, key)  # [B, k]
        n_br, ln = self.num_branches(k), self.branch_len
        bounds = jax.lax.top_k(boundary_scores(s1.conf), n_br)[1].astype(jnp.int32)  # [B, K]
        with jax.named_scope("draft_branches"):
            br, s2 = self._branches(state.second, ctx, chain, bounds, k)  # [B, K, L]
        parents, _, valid = tree_layout(k, n_br, ln, bounds)
        b = chain.shape[0]
        tokens = jnp.concatenate([chain, br.reshape(b, -1)], axis=1)
        # Node 0 of the layout is `last`: drafted node t is layout node t + 1.
        tokens = jnp.where(valid[:, 1:], tokens, -1)
        return (Proposal(tokens=tokens, parents=parents[:, 1:] - 1),
                D2SDState(first=s1, second=s2))

    def _branches(self, st: DFlashState, ctx: DraftContext, chain: jax.Array, bounds: jax.Array,
                  k: int) -> tuple[jax.Array, DFlashState]:
        """i32[B, K, branch_len] re-drafted tokens at slots bounds + 1 + m, one batched pass."""
        d = self.second
        cfg, p = d.cfg, d.params
        ck, cv, last_c = d.ingest(st)
        b, n_br = bounds.shape
        gamma = k + 1
        blk = jnp.concatenate([ctx.last[:, None], chain], axis=1)  # [B, γ]
        blk = jnp.broadcast_to(blk[:, None], (b, n_br, gamma))
        x = block_inputs_prefix(p, d.embed, blk, bounds,
                                jnp.broadcast_to(last_c[:, None], (b, n_br, last_c.shape[-1])))
        qpos = ctx.cache_len[:, None] + jnp.tile(jnp.arange(gamma, dtype=jnp.int32), n_br)[None]
        slots = jnp.arange(ck[0].shape[2], dtype=jnp.int32)
        ctx_mask = jnp.broadcast_to(slots[None, None, :] < ctx.cache_len[:, None, None],
                                    (b, n_br * gamma, slots.shape[0]))
        bid = jnp.repeat(jnp.arange(n_br), gamma)
        block_mask = jnp.broadcast_to(bid[:, None] == bid[None, :], (b, n_br * gamma, n_br * gamma))
        h = block_forward(cfg, p, x, qpos, list(zip(ck, cv, strict=True)), ctx_mask, block_mask)
        h = h.reshape(b, n_br, gamma, -1)
        mm = jnp.arange(self.branch_len, dtype=jnp.int32)
        slot = jnp.minimum(bounds[:, :, None] + 1 + mm, gamma - 1)  # [B, K, L]
        hs = jnp.take_along_axis(h, slot[..., None], axis=2)  # [B, K, L, D]
        logits = draft_logits(cfg, p, d.head, hs)  # [B, K, L, Vd]
        # The branch's first token is an alternative to the chain's token at that depth.
        chain_tok = jnp.take_along_axis(chain, jnp.minimum(bounds, k - 1), axis=1)  # [B, K]
        dup = d.vocab_ids[None, None, :] == chain_tok[:, :, None]  # [B, K, Vd]
        first = mm[None, None, :, None] == 0
        logits = jnp.where(first & dup[:, :, None, :], NEG, logits)
        toks = d.vocab_ids[argmax(logits)].astype(jnp.int32)
        return toks, dataclasses.replace(st, ck=ck, cv=cv, last_c=last_c)


def make(first: DFlash, cfg: DrafterConfig, params: DFlashParams, vocab_ids: Any, target_weights: Any,
         branches: int = 4, branch_len: int = 1, name: str = "d2sd") -> D2SD:
    """A D²SD drafter from a loaded first drafter and the second drafter's file contents."""
    if not isinstance(first, DFlash):
        raise JspecError(f"the D2SD first drafter must be a DFlash drafter, got "
                         f"{type(first).__name__}")
    if first.cut > 0:
        raise JspecError("the D2SD first drafter drafts whole blocks: no cut=")
    fc = first.cfg
    same = (fc.feature_layers == cfg.feature_layers and fc.hidden_size == cfg.hidden_size
            and fc.draft_vocab == cfg.draft_vocab and fc.target_vocab == cfg.target_vocab)
    if not same:
        raise JspecError("the D2SD second drafter does not match its first drafter (feature "
                         "layers, hidden size or vocabularies differ)")
    second = dflash.make(dataclasses.replace(cfg, kind="dflash"), params, vocab_ids,
                         target_weights, name=name + "/second")
    if not bool(jnp.all(second.vocab_ids == first.vocab_ids)):
        raise JspecError("the D2SD drafters must share one draft vocabulary")
    return D2SD(first=first, second=second, branches=branches, branch_len=branch_len, name=name)
