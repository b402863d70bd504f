"""A top-k token tree from any chain drafter (`name+topk:k=K,nodes=N`).

One `draft` of the inner chain drafter gives the chain x_1..x_L and, at every level t, its
draft distribution q_t. The tree expands the `k` most probable children of each chain node
(the chain's own next token among them, the others leaves) and keeps the `nodes` best nodes by
cumulative draft probability P(x_1..x_{t-1}) · q_t(c) (a node is never kept without its
parent: a child's score is at most its parent's, ties go to the shallower node). The round
verifies the tree in one target forward and walks it along the target's tokens
(`jspec.verify.tree`), so the output is the target's at every temperature, whatever the
drafter proposes.

Why only the chain grows: every branch is one token off the chain, so a path through a
sibling at depth t is, to the inner drafter, a chain whose token t was replaced — the same
as a rejection at t with a different correction token, which every chain drafter already
handles (its caches are re-fed from the committed tokens and the path's target features).
Deeper branches need a drafter that can step several continuations at once (EAGLE-2 style).

The inner drafter drafts at temperature `draft_temperature` over its top k + 1 tokens, so
its q shows the candidates at every temperature of the target; the cumulative scores use
the drafter's own probabilities over those tokens (q^T renormalised, which undoes the
temperature). A drafter without q (n-gram) gives the chain alone.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters.base import Capabilities, DraftContext, Drafter, Proposal
from jspec.errors import JspecError
from jspec.sampling import Sampling


def tree_nodes(k: int, nodes: int, chain: int) -> int:
    """Nodes of a top-k tree over a chain of `chain` tokens: the budget, at most every
    candidate (the chain and k - 1 siblings per level)."""
    return min(nodes, chain * k)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TopKTree:
    """A tree drafter around a chain drafter `inner` (see the module docstring).

    k: children kept per chain node (the chain's own token and k - 1 siblings), >= 1.
    nodes: node budget N per round (static; the verify forward scores N + 1 tokens).
    """

    inner: Any
    k: int = dataclasses.field(metadata=dict(static=True), default=4)
    nodes: int = dataclasses.field(metadata=dict(static=True), default=16)
    draft_temperature: float = dataclasses.field(metadata=dict(static=True), default=0.25)
    name: str = dataclasses.field(metadata=dict(static=True), default="topk-tree")
    default_k: int = dataclasses.field(metadata=dict(static=True), default=0)  # 0: inner's
    max_batch: int = dataclasses.field(metadata=dict(static=True), default=-1)  # -1: inner's

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Drafter) or self.inner.caps.tree:
            raise JspecError("a top-k tree needs a chain drafter (n-gram, early-exit, EAGLE-3, "
                             f"DFlash), got {type(self.inner).__name__}")
        if not isinstance(self.k, int) or self.k < 1:
            raise JspecError(f"top-k tree k must be an integer >= 1, got {self.k!r}")
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise JspecError(f"top-k tree nodes must be an integer >= 1, got {self.nodes!r}")
        if not 0 < self.draft_temperature <= 1:
            raise JspecError("top-k tree draft_temperature must be in (0, 1], got "
                             f"{self.draft_temperature!r}")

    @property
    def caps(self) -> Capabilities:
        c = self.inner.caps
        return Capabilities(feature_layers=c.feature_layers, feature_norm=c.feature_norm,
                            tree=True, nodes=functools.partial(tree_nodes, self.k, self.nodes),
                            default_k=self.default_k or c.default_k,
                            max_batch=c.max_batch if self.max_batch < 0 else self.max_batch)

    def init_state(self, features: jax.Array | None, prompt_ids: jax.Array,
                   prompt_lengths: jax.Array, capacity: int, *, k: int,
                   verify_width: int | None = None) -> Any:
        return self.inner.init_state(features, prompt_ids, prompt_lengths, capacity, k=k,
                                     verify_width=k)

    def observe(self, state: Any, feats: jax.Array, start: jax.Array, count: jax.Array) -> Any:
        return self.inner.observe(state, feats, start, count)

    def draft(self, state: Any, ctx: DraftContext, k: int, sampling: Sampling,
              key: jax.Array) -> tuple[Proposal, Any]:
        """The chain of length k and the best `caps.lookahead(k)` nodes of its top-k tree."""
        inner_sampling = Sampling(temperature=self.draft_temperature, top_k=self.k + 1)
        chain, state = self.inner.draft(state, ctx, k, inner_sampling, key)
        tokens, parents = top_k_tree(chain.tokens, chain.q, self.k,
                                     tree_nodes(self.k, self.nodes, k), self.draft_temperature,
                                     q_vocab=chain.q_vocab)
        return Proposal(tokens=tokens, parents=parents), state


def top_k_tree(chain: jax.Array, q: jax.Array | None, k: int, n: int, temperature: float,
               q_vocab: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The best n nodes of the top-k tree around a drafted chain.

    Args:
      chain: i32[B, L] drafted chain (-1: nothing proposed; the chain ends there).
      q: f32[B, L, Vq] the drafter's distributions at temperature `temperature` over the
        target ids `q_vocab` (None: all V) (q None: the chain alone).
      k: children per chain node; n: nodes kept (<= L·k).
    Returns:
      (tokens i32[B, n] (-1: empty node), parents i32[B, n] (-1: `last`)), in topological order.
      Candidates are laid out level by level: the chain token, then k - 1 siblings.
    """
    b, length = chain.shape
    ok = jnp.cumprod(chain >= 0, axis=1).astype(bool)  # [B, L] the chain up to its first gap
    if q is None:  # one-hot drafts: only the chain
        sib_tok = jnp.zeros((b, length, k - 1), jnp.int32)
        sib_logp = jnp.full((b, length, k - 1), -jnp.inf)
        chain_logp = jnp.zeros((b, length))
    else:
        # The drafter's own probabilities over its top tokens: q^T renormalised.
        logq = jnp.log(jnp.maximum(q, 1e-30)) * temperature
        logq = jnp.where(q > 0, logq, -jnp.inf)
        logq = logq - jax.nn.logsumexp(logq, axis=-1, keepdims=True)
        top_logp, top_tok = jax.lax.top_k(logq, k)  # [B, L, k]
        safe_chain = jnp.maximum(chain, 0)
        if q_vocab is None:
            chain_logp = jnp.take_along_axis(logq, safe_chain[..., None], axis=-1)[..., 0]
        else:  # entries of q are the target ids q_vocab
            top_tok = q_vocab[top_tok]
            at_chain = q_vocab[None, None, :] == safe_chain[..., None]  # [B, L, Vq]
            chain_logp = jnp.max(jnp.where(at_chain, logq, -jnp.inf), axis=-1)
        # Siblings: the top tokens other than the chain's own (k - 1 of them).
        is_chain = top_tok == safe_chain[..., None]
        order = jnp.argsort(is_chain, axis=-1, stable=True)[..., : k - 1]  # chain token last
        sib_tok = jnp.take_along_axis(top_tok, order, axis=-1).astype(jnp.int32)
        sib_logp = jnp.take_along_axis(top_logp, order, axis=-1)
        sib_logp = jnp.where(jnp.take_along_axis(is_chain, order, axis=-1), -jnp.inf, sib_logp)
    chain_logp = jnp.where(ok, chain_logp, -jnp.inf)
    # A level the drafter left empty (-1: VAT cut, no n-gram match) ends the tree there.
    sib_logp = jnp.where(ok[..., None], sib_logp, -jnp.inf)
    # Cumulative log-probability of the chain prefix before each level.
    before = jnp.concatenate([jnp.zeros((b, 1)), jnp.cumsum(chain_logp, axis=1)[:, :-1]], axis=1)
    ok_before = jnp.concatenate([jnp.ones((b, 1), bool), ok[:, :-1]], axis=1)
    before = jnp.where(ok_before, before, -jnp.inf)
    score = jnp.concatenate([(before + chain_logp)[..., None], before[..., None] + sib_logp],
                            axis=-1)  # [B, L, k]
    tok = jnp.concatenate([chain[..., None], sib_tok], axis=-1)
    level = jnp.broadcast_to(jnp.arange(length)[None, :, None], (b, length, k))
    # Parent candidate: the chain node one level up (-1 for level 0).
    parent_cand = jnp.where(level > 0, (level - 1) * k, -1)
    m = length * k
    score, tok, parent_cand = (a.reshape(b, m) for a in (score, tok, parent_cand))
    # Ties (q = 1 at a level) go to the shallower node, so a parent outranks its children.
    rank_key = jnp.where(jnp.isfinite(score), score, -1e30) - 1e-6 * level.reshape(b, m)
    keep_idx = jnp.sort(jax.lax.top_k(rank_key, n)[1], axis=-1)  # [B, n] candidate order
    kept = jnp.zeros((b, m), bool).at[jnp.arange(b)[:, None], keep_idx].set(True)
    pos = jnp.cumsum(kept, axis=1) - 1  # candidate -> its index among the kept nodes
    par_c = jnp.take_along_axis(parent_cand, keep_idx, axis=1)
    par_kept = jnp.take_along_axis(kept, jnp.maximum(par_c, 0), axis=1)
    parents = jnp.where(par_c >= 0, jnp.take_along_axis(pos, jnp.maximum(par_c, 0), axis=1), -1)
    valid = (jnp.isfinite(jnp.take_along_axis(score, keep_idx, axis=1))
             & ((par_c < 0) | par_kept))
    tokens = jnp.where(valid, jnp.take_along_axis(tok, keep_idx, axis=1), -1)
    return tokens.astype(jnp.int32), parents.astype(jnp.int32)


def from_options(inner: Any, k: int = 4, nodes: int = 16) -> TopKTree:
    """`load_drafter`'s `INNER+topk:k=K,nodes=N`."""
    return TopKTree(inner=inner, k=k, nodes=nodes, name=f"{getattr(inner, 'name', 'drafter')}+topk")
