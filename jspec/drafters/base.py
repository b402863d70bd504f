"""The drafter protocol: what a drafter declares (`Capabilities`) and proposes (`Proposal`).

A drafter is a pytree (its weights are leaves, its configuration static) with
  caps                                                   -> Capabilities (static)
  init_state(features, prompt_ids, prompt_lengths, capacity, *, k, verify_width) -> state
  draft(state, ctx, k, sampling, key)                    -> (Proposal, state)
  observe(state, feats, start, count)                    -> state
The round (`jspec.rounds`) reads nothing else of a drafter. `ChainDrafter` is the base of
drafters that propose chains: they implement
  propose(state, ctx, k, sampling, key) -> (tokens i32[B, k], q f32[B, k, Vq] | None, state)
and `draft` wraps it. `q` is the draft distribution after the same temperature/top-k/top-p
processing as the target's, over the drafter's own vocabulary `q_vocab` (i32[Vq] target token
ids; None: the whole target vocabulary, Vq = V), or None when the draft is deterministic
(one-hot: n-gram lookup, or any greedy drafter). A drafter with a 4,096-token head keeps q
12x smaller than [B, k, V]; `jspec.sampling.dense_q` scatters it to the target vocabulary where needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from jspec.defaults import Settings
from jspec.errors import JspecError
from jspec.models.llama import tree_ancestors
from jspec.sampling import Sampling


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftContext:
    """What a drafter may read about the committed sequence."""

    seq: jax.Array  # i32[B, C] prompt + committed tokens (incl. `last`), junk beyond seq_len
    cache_len: jax.Array  # i32[B] committed tokens in the target cache (all but `last`)
    last: jax.Array  # i32[B] last committed token (= seq[b, cache_len[b]])


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a drafter is, declared once (static; `generate` and the round read only this).

    feature_layers: target layers whose hidden states it reads (sorted, unique; () for none).
    feature_norm: "rms" (each feature divided by its RMS) or "none" (raw; imported checkpoints).
    may_abstain: it may propose nothing (-1) for a whole batch: the round then runs a one-token
      forward instead of the verify block.
    tree: its proposals are trees (`Proposal.parents` set); verified by a `trees` verifier.
    block_tokens: > 0 for a block drafter that can `extend(state, ctx, anchor, offset,
      sampling, key)` by blocks of this many tokens (LibraSpec drafts with it).
    hidden_size: > 0 when its proposals carry hidden states f32[B, N, hidden_size] (a verifier
      with `needs_hidden`, DIVERSED's context head, reads them).
    nodes: the nodes a proposal holds for chain length k (None: k): a tree's node budget, or
      a chain proposer's longer chains (`INNER+ngram:look=L`, max(k, L) nodes, of which the
      inner drafter's rows fill the first k).
    path: the most drafted tokens one round can accept for chain length k (None: a tree's
      depth k, a chain's nodes); a tree whose rows may instead propose a longer looked-up
      chain (`TREE+ngram:look=L`) accepts up to max(k, L).
    expands: a chain drafter that can also step several continuations at once (EAGLE-2-style
      trees, `jspec.drafters.topk_tree.expand_tree`): it implements
      `draft_tree(state, ctx, *, depth, k, width, n[, sampling, key]) -> (tokens, parents, q,
      state)` (q: the distributions children were drawn from at T > 0, else None), its state
      made with (depth - 1) * width cache slots past the capacity for the tree's entries.
    widths: the static verify widths a proposal for chain length k can need, ascending, the
      last its nodes (None: a chain's (k, nodes), a tree's (nodes,)): a proposer whose rows
      fill fewer nodes in some rounds (`+ngram:look=L`: the inner chain of k, or a looked-up
      chain shorter than a tree's node budget) names the smaller widths too, and a round
      verifies the smallest one its live rows need.
    What was measured for a drafter (its default chain length, the batch past which plain
    decoding is faster) is not here: it is the drafter's `Settings`, from its `jspec.defaults`
    record (`settings_of`).
    """

    feature_layers: tuple[int, ...] = ()
    feature_norm: str = "rms"
    may_abstain: bool = False
    tree: bool = False
    block_tokens: int = 0
    hidden_size: int = 0
    nodes: Callable[[int], int] | None = None
    path: Callable[[int], int] | None = None
    expands: bool = False
    widths: Callable[[int], tuple[int, ...]] | None = None

    def lookahead(self, k: int) -> int:
        """Cache slots a round writes beyond `last` for chain length k (its proposal's nodes)."""
        return k if self.nodes is None else self.nodes(k)

    def verify_widths(self, k: int) -> tuple[int, ...]:
        """The static widths (nodes after `last`) a round may verify for chain length k."""
        if self.widths is not None:
            return self.widths(k)
        n = self.lookahead(k)
        return (n,) if self.tree or n == k else (k, n)

    def path_len(self, k: int) -> int:
        """The most drafted tokens one round can accept for chain length k: a tree's depth k,
        a chain's nodes, unless `path` says otherwise."""
        if self.path is not None:
            return self.path(k)
        return k if self.tree else self.lookahead(k)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Proposal:
    """What a drafter proposes in one round: a token tree of N nodes per row after `last`.

    A chain is the tree whose node t has parent t - 1 (`parents` None, which the round verifies
    with the causal mask). Node order is topological (a parent before its children).
    """

    tokens: jax.Array  # i32[B, N] drafted tokens; -1: nothing proposed at that node
    q: jax.Array | None = None  # f32[B, N, Vq] draft distributions (None: one-hot / greedy)
    q_vocab: jax.Array | None = None  # i32[Vq] target ids of q's entries; None: all V
    parents: jax.Array | None = None  # i32[B, N] parent node, -1 = `last`; None: a chain
    conf: jax.Array | None = None  # f32[B, N] confidences (LibraSpec)
    hidden: jax.Array | None = None  # f32[B, N, D] drafter hidden states (DIVERSED's head)
    # A tree's most children per node (static; 0: unknown). With q at T > 0 a tree's node t
    # was drawn from q[:, t] (siblings from one q, without replacement, in node order).
    branching: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    @property
    def valid(self) -> jax.Array:
        """bool[B, N] nodes with a proposed token."""
        return self.tokens >= 0

    def depth(self) -> jax.Array:
        """i32[B, N] tokens from `last` to the node (1 for `last`'s children)."""
        b, n = self.tokens.shape
        if self.parents is None:
            return jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.int32), (b, n))
        anc = tree_ancestors(self.parents)  # [B, N, N]: the node and its drafted ancestors
        return jnp.sum(anc, axis=-1).astype(jnp.int32)


@runtime_checkable
class Drafter(Protocol):
    """The protocol every drafter implements (`ChainDrafter` for chain drafters)."""

    @property
    def caps(self) -> Capabilities: ...

    def init_state(self, features: jax.Array | None, prompt_ids: jax.Array,
                   prompt_lengths: jax.Array, capacity: int, *, k: int,
                   verify_width: int) -> Any: ...

    def draft(self, state: Any, ctx: DraftContext, k: int, sampling: Sampling,
              key: jax.Array) -> tuple[Proposal, Any]: ...

    def observe(self, state: Any, feats: jax.Array, start: jax.Array,
                count: jax.Array) -> Any: ...


@runtime_checkable
class BlockDrafter(Drafter, Protocol):
    """A drafter with `caps.block_tokens` > 0 (DFlash): LibraSpec (`jspec.length`) and
    calibration draft further blocks with `extend`. Test for it with `is_block_drafter`."""

    def extend(self, state: Any, ctx: DraftContext, anchor: jax.Array, offset: jax.Array | int,
               sampling: Sampling, key: jax.Array
               ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """(tokens i32[B, b], q f32[B, b, Vq] | None, confidences f32[B, b]) of one more
        block anchored on the drafted token `anchor` i32[B] at `offset` after `last`."""
        ...


@runtime_checkable
class TreeExpander(Drafter, Protocol):
    """A chain drafter with `caps.expands` (EAGLE-3): `jspec.drafters.topk_tree` grows
    EAGLE-2-style trees with `draft_tree`. Test for it with `is_tree_expander`."""

    def draft_tree(self, state: Any, ctx: DraftContext, *, depth: int, k: int, width: int,
                   n: int, sampling: Sampling | None = None, key: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array, jax.Array | None, Any]:
        """(tokens i32[B, n], parents i32[B, n], q (the distributions children were drawn
        from at T > 0, else None), state) of a `depth`-level tree, `width` nodes expanded a
        level, `k` children each."""
        ...


def is_block_drafter(drafter: Any) -> bool:
    """Whether `drafter` declares block drafting (`BlockDrafter.extend`): its
    `caps.block_tokens` > 0. The declaration, not a probe for the method."""
    return drafter.caps.block_tokens > 0


def is_tree_expander(drafter: Any) -> bool:
    """Whether `drafter` declares EAGLE-2-style tree growth (`TreeExpander.draft_tree`)."""
    return drafter.caps.expands


@runtime_checkable
class Measured(Protocol):
    """A drafter that carries measured settings (`ChainDrafter`, `Proposer` and the drafters
    loaded by name: `load_drafter` attaches its `jspec.defaults` record's)."""

    @property
    def settings(self) -> Settings: ...


def settings_of(drafter: Any) -> Settings:
    """The measured settings `generate` uses for `drafter` (the chain length when given no
    `length=`, the batch past which it decodes plainly): its own, or the defaults (k = 5, no
    batch limit) for a drafter that carries none."""
    return drafter.settings if isinstance(drafter, Measured) else Settings()


class ChainDrafter:
    """Base of chain drafters: `draft` from `propose`; no target features by default. A
    subclass's `default_k` / `max_batch` fields hold its measured `settings` (from its record
    when loaded by name)."""

    name = "drafter"
    default_k: int = 5
    max_batch: int | None = None

    @property
    def settings(self) -> Settings:
        """The measured settings this drafter carries (`settings_of`)."""
        return Settings(k=self.default_k, max_batch=self.max_batch)

    @property
    def caps(self) -> Capabilities:
        return Capabilities()

    @property
    def q_vocab(self) -> jax.Array | None:
        """i32[Vq]: the target ids `propose`'s q is over; None: the whole vocabulary."""
        return None

    def propose(self, state: Any, ctx: DraftContext, k: int, sampling: Sampling,
                key: jax.Array) -> tuple[jax.Array, jax.Array | None, Any]:
        raise NotImplementedError

    def draft(self, state: Any, ctx: DraftContext, k: int, sampling: Sampling,
              key: jax.Array) -> tuple[Proposal, Any]:
        tokens, q, state = self.propose(state, ctx, k, sampling, key)
        return Proposal(tokens=tokens, q=q, q_vocab=self.q_vocab), state

    def observe(self, state: Any, feats: jax.Array, start: jax.Array,
                count: jax.Array) -> Any:
        """Target features of the accepted path f32[B, M, F, D] at positions start..,
        `count` valid (drafters with `caps.feature_layers`); nothing to do by default."""
        return state


@dataclasses.dataclass(frozen=True)
class Proposer:
    """Base of the proposers around a chain drafter `inner` (`INNER+name`: `TopKTree`,
    `LookupFirst`): the inner drafter's state follows the committed text (`init_state`,
    `observe` pass through), and the proposer inherits its feature layers and its measured
    `settings` unless given its own (`default_k` 0: the inner's; `max_batch` -1: the inner's).
    Subclasses are registered dataclasses: `inner` is a pytree child, the rest static."""

    inner: Any
    name: str = dataclasses.field(metadata=dict(static=True), default="proposer")
    default_k: int = dataclasses.field(metadata=dict(static=True), default=0)  # 0: inner's
    max_batch: int | None = dataclasses.field(metadata=dict(static=True),
                                              default=-1)  # -1: inner's
    what = "a proposer"  # for the error naming a non-chain inner drafter
    takes_trees = False  # whether `inner` may also be a tree drafter (`+topk`)

    def __post_init__(self) -> None:
        # A chain drafter of k tokens: not a proposer whose chains run longer, nor a tree
        # unless this proposer takes trees.
        c = self.inner.caps if isinstance(self.inner, Drafter) else None
        if c is None or (c.tree and not self.takes_trees) or (c.nodes is not None
                                                              and not c.tree):
            trees = ", or a +topk tree" if self.takes_trees else ""
            raise JspecError(f"{self.what} needs a chain drafter (n-gram, early-exit, EAGLE-3, "
                             f"DFlash, a draft model){trees}, got {type(self.inner).__name__}")

    def inherited_caps(self, **kw: Any) -> Capabilities:
        """The inner drafter's feature layers + kw."""
        c = self.inner.caps
        return Capabilities(feature_layers=c.feature_layers, feature_norm=c.feature_norm, **kw)

    @property
    def settings(self) -> Settings:
        """The inner drafter's measured settings, this proposer's where set."""
        inner = settings_of(self.inner)
        return Settings(k=self.default_k or inner.k,
                        max_batch=inner.max_batch if self.max_batch == -1 else self.max_batch)

    def init_state(self, features: jax.Array | None, prompt_ids: jax.Array,
                   prompt_lengths: jax.Array, capacity: int, *, k: int,
                   verify_width: int | None = None) -> Any:
        return self.inner.init_state(features, prompt_ids, prompt_lengths, capacity, k=k,
                                     verify_width=verify_width)

    def observe(self, state: Any, feats: jax.Array, start: jax.Array, count: jax.Array) -> Any:
        return self.inner.observe(state, feats, start, count)
