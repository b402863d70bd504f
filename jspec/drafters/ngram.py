"""Prompt/context lookup drafting: continue the latest earlier occurrence of the suffix n-gram."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters.base import Capabilities, ChainDrafter, DraftContext, Proposal, Proposer
from jspec.errors import JspecError
from jspec.sampling import Sampling


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class NGram(ChainDrafter):
    """Propose the k tokens that followed the latest earlier match of the longest suffix n-gram.

    n_max..n_min: suffix lengths tried, longest first. Deterministic, so q is one-hot.
    A continuation that reaches the current end goes on periodically (the match's own
    continuation: "x y x y" proposes "x y x ..."). A row with no match proposes nothing (-1):
    verification treats it as rejected, and a round in which no row has a proposal costs a
    one-token forward instead of a k+1-token one.
    """

    n_max: int = 3
    n_min: int = 1
    default_k: int = 5
    max_batch: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.n_min <= self.n_max:
            raise JspecError(f"NGram needs 1 <= n_min <= n_max, got {self.n_min}, {self.n_max}")

    name = "ngram"

    @property
    def caps(self) -> Capabilities:
        return Capabilities(may_abstain=True)

    def init_state(self, features: Any, prompt_ids: jax.Array, prompt_lengths: jax.Array,
                   capacity: int, *, k: int = 0, verify_width: int = 0) -> None:
        return None

    def lookup(self, seq: jax.Array, seq_len: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        """(tokens i32[B, k] with -1 where nothing is proposed, found bool[B]) for seq i32[B, C]
        with seq_len i32[B] valid entries."""
        b, c = seq.shape
        j = jnp.arange(c, dtype=jnp.int32)[None, :]  # candidate end positions of a match
        best_end = jnp.full((b,), -1, jnp.int32)
        for n in range(self.n_max, self.n_min - 1, -1):
            match = (j >= n - 1) & (j <= seq_len[:, None] - 2)
            for i in range(n):
                tail = jnp.take_along_axis(seq, jnp.maximum(seq_len - 1 - i, 0)[:, None], axis=1)
                shifted = jnp.roll(seq, i, axis=1)  # shifted[:, j] = seq[:, j - i]
                match = match & (shifted == tail)
            end = jnp.max(jnp.where(match, j, -1), axis=1)
            best_end = jnp.where(best_end >= 0, best_end, end)
        found = best_end >= 0
        # What followed the match, read on into the present: where it reaches the current end
        # it goes on as the match did (the text from the match on repeats with period P, the
        # distance from the match to the end), so a recent match still gives k tokens.
        period = jnp.maximum(seq_len - 1 - best_end, 1)[:, None]  # [B, 1]
        idx = best_end[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :] % period
        tokens = jnp.take_along_axis(seq, jnp.clip(idx, 0, c - 1), axis=1)
        return jnp.where(found[:, None], tokens, -1), found

    def propose(self, state: None, ctx: DraftContext, k: int, sampling: Sampling,
                key: jax.Array) -> tuple[jax.Array, None, None]:
        tokens, _ = self.lookup(ctx.seq, ctx.cache_len + 1, k)
        return tokens, None, state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LookupFirst(Proposer):
    """A chain drafter (or a `+topk` tree) whose proposal gives way to the n-gram lookup's
    where the text repeats (`INNER+ngram[:n_min=M,n_max=N,look=L]`).

    Every round the inner drafter drafts as usual (its state follows the committed text either
    way); in each row whose committed text ends in an n-gram of at least `n_min` tokens seen
    earlier (longest first, up to `n_max`), the proposal is that occurrence's continuation
    instead (`NGram.lookup`). When sampling, its q rows there are empty: a row that gives its
    own token no mass is a deterministic slot, which verification treats as q one-hot at the
    token (`verify_chain`; a drawn tree's `verify_tree_drawn` the same way) — the lookup is a
    deterministic function of the committed text, so verification stays lossless, and a
    looked-up token need not be in the inner drafter's q vocabulary.

    `look` > k: a looked-up continuation runs to `look` tokens (the inner drafter's chain stays
    k); the round verifies `look` tokens only when some live row looked one up, else k
    (`FixedLength.verify_widths_for`). A repeated stretch of text is accepted far more often
    than a drafted guess, and on a CPU whose verify cost is flat in K the longer check is
    nearly free.

    Around a tree (`INNER+topk:...+ngram`) a looked-up row proposes its chain as the tree
    whose node t has parent t - 1 (up to max(depth, L) tokens; the proposal holds the larger
    of that and the tree's node budget), the other rows their trees; the round verifies and
    walks both the same way, at every temperature, at the width its live rows need: the tree's
    node budget, or the looked-up chain's length when every live row looked one up
    (`Capabilities.widths`; a small tree's rounds then need not verify L nodes, nor a
    looked-up chain the tree's budget).

    A trained drafter and the lookup miss in different places: on held-out greedy answers,
    following the n-gram continuation wherever a 2-token suffix repeats raises greedy τ of the
    shipped EAGLE-3 by 14-17% at K = 2-3 (docs/BENCHMARKS.md, "... the n-gram lookup first").
    """

    n_max: int = dataclasses.field(metadata=dict(static=True), default=3)
    n_min: int = dataclasses.field(metadata=dict(static=True), default=2)
    look: int = dataclasses.field(metadata=dict(static=True), default=0)  # 0: the round's k
    what = "+ngram"
    takes_trees = True

    def __post_init__(self) -> None:
        super().__post_init__()
        NGram(n_max=self.n_max, n_min=self.n_min)  # the same checks
        if not isinstance(self.look, int) or not 0 <= self.look <= 64:
            raise JspecError(f"+ngram look must be an integer in [0, 64] (0: the chain length "
                             f"k), got {self.look!r}")

    @property
    def caps(self) -> Capabilities:
        # No block extension (LibraSpec) nor DIVERSED hidden states: a looked-up chain has
        # neither. It abstains only where the inner drafter does: a looked-up chain replaces a
        # row's proposal only when its first token is known. Around a tree (`+topk`) it stays
        # a tree: a looked-up chain is the tree whose node t has parent t - 1.
        c = self.inner.caps
        if not c.tree and not self.look:
            return self.inherited_caps(may_abstain=c.may_abstain)
        return self.inherited_caps(may_abstain=c.may_abstain, tree=c.tree,
                                   nodes=functools.partial(_lookahead, c, self.look),
                                   path=functools.partial(_path_len, c, self.look),
                                   widths=functools.partial(_widths, c, self.look))

    def draft(self, state: Any, ctx: DraftContext, k: int, sampling: Sampling,
              key: jax.Array) -> tuple[Proposal, Any]:
        prop, state = self.inner.draft(state, ctx, k, sampling, key)
        c = self.inner.caps
        n, m = _lookahead(c, self.look, k), _path_len(c, self.look, k)  # nodes, chain length
        looked, found = NGram(n_max=self.n_max, n_min=self.n_min).lookup(
            ctx.seq, ctx.cache_len + 1, m)  # [B, m], [B]
        q, own, par = prop.q, prop.tokens, prop.parents
        pad = n - own.shape[1]  # the inner's rows propose nothing past its own nodes
        own = jnp.pad(own, ((0, 0), (0, pad)), constant_values=-1)
        looked = jnp.pad(looked, ((0, 0), (0, n - m)), constant_values=-1)
        use = found & (looked[:, 0] >= 0)  # [B] (a match's first token is always known)
        if q is not None:  # empty rows: deterministic slots, verified as q one-hot
            q = jnp.where(use[:, None, None], 0.0, jnp.pad(q, ((0, 0), (0, pad), (0, 0))))
        tokens = jnp.where(use[:, None], looked, own)
        if par is not None:  # a tree: the looked-up rows' chain, node t's parent t - 1
            par = jnp.pad(par, ((0, 0), (0, pad)), constant_values=-1)
            chain = jnp.arange(-1, n - 1, dtype=jnp.int32)[None]
            par = jnp.where(use[:, None], chain, par)
        return Proposal(tokens=tokens, q=q, q_vocab=prop.q_vocab, parents=par,
                        branching=prop.branching), state


def _lookahead(inner: Capabilities, look: int, k: int) -> int:
    """Nodes of a `+ngram:look=L` proposal for chain length k: the inner drafter's (k for a
    chain, a tree's budget) or the looked-up chain's, whichever is more."""
    return max(inner.lookahead(k), _path_len(inner, look, k))


def _widths(inner: Capabilities, look: int, k: int) -> tuple[int, ...]:
    """Verify widths for chain length k: the inner drafter's (a chain's k, a tree's node
    budget) and the looked-up chain's, ascending (a round in which no live row looked one up
    verifies the inner proposal's width, one in which every live row did the chain's)."""
    return tuple(sorted({*inner.verify_widths(k), _path_len(inner, look, k)}))


def _path_len(inner: Capabilities, look: int, k: int) -> int:
    """The longest looked-up chain (and accepted path) for chain length k: L, or the inner's
    path (k) when L is 0 or shorter."""
    return max(inner.path_len(k), look)


def lookup_first(inner: Any, n_max: int | None = None, n_min: int = 2,
                 look: int = 0) -> LookupFirst:
    """`load_drafter`'s `INNER+ngram:n_min=M,n_max=N,look=L` (n_max default: max(3, n_min);
    look default 0: looked-up chains as long as the drafter's)."""
    return LookupFirst(inner=inner, n_max=max(3, n_min) if n_max is None else n_max, n_min=n_min,
                       look=look, name=f"{getattr(inner, 'name', 'drafter')}+ngram")
