"""Top-k token trees from chain drafters (`name+topk:k=K,nodes=N[,width=W]`).

A drafter that can step several continuations at once (`caps.expands`: EAGLE-3) grows the
tree EAGLE-2 style (`expand_tree`): its `k` most probable first tokens are the first level;
at every further level the `width` best nodes of the level before, by cumulative draft
probability P(x_1..x_t), are fed to the drafter in one batched step (each attends to the
committed context and its own ancestors), and each contributes its `k` most probable
children. After `depth` levels (the round's chain length) the `nodes` best of all candidates
are kept (a node is never kept without its parent: a child's score is at most its parent's,
ties go to the shallower node). With width = 1 the expanded nodes are the drafter's greedy
chain, each level adding k - 1 siblings.

Any other chain drafter (n-gram, early-exit, DFlash) gives one chain x_1..x_L and, at every
level t, its draft distribution q_t: the tree is then the degenerate case that expands only
the chain — the `k` most probable children of each chain node (the chain's own next token
among them, the others leaves). A path through a sibling at depth t is, to the inner
drafter, a chain whose token t was replaced — the same as a rejection at t with a different
correction token, which every chain drafter already handles (its caches are re-fed from the
committed tokens and the path's target features). That inner drafter drafts at temperature
`draft_temperature` over its top k + 1 tokens, so its q shows the candidates at every
temperature of the target; the cumulative scores use the drafter's own probabilities over
those tokens (q^T renormalised, which undoes the temperature). A drafter without q (n-gram)
gives the chain alone.

Either way the round verifies the tree in one target forward and walks it along the target's
tokens (`jspec.verify.tree`), so the output is the target's at every temperature, whatever
the drafter proposes.

At T > 0 an expanding drafter's tree is drawn instead (`draw`, on by default): each expanded
node's k children are drawn from its q (the distribution a chain would be sampled from)
without replacement, the tree keeps the first `nodes` candidates in an order that never looks
at a candidate's own token, and the proposal carries q, so the round verifies it by recursive
rejection sampling (`jspec.verify.tree.verify_tree_drawn`): a child is accepted with
min(1, p/q) of the residual rather than only when the target's sample equals it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters.base import Capabilities, DraftContext, Proposal, Proposer
from jspec.errors import JspecError
from jspec.sampling import NEG, Sampling


def tree_nodes(k: int, nodes: int, width: int, chain: int) -> int:
    """Nodes of a top-k tree of depth `chain`: the budget, at most every candidate (width 0,
    chain-only: the chain and k - 1 siblings per level; width W: k first tokens, then k
    children of each of W expanded nodes per level)."""
    cands = chain * k if width == 0 else k + (chain - 1) * width * k
    return min(nodes, cands)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TopKTree(Proposer):
    """A tree drafter around a chain drafter `inner` (see the module docstring; `Proposer`:
    the inner's state, feature layers and defaults).

    k: children per expanded node, >= 1.
    nodes: node budget N per round (static; the verify forward scores N + 1 tokens).
    width: nodes expanded per level by a drafter that expands (1 <= width <= k; 0: k).
    draw: at T > 0, an expanding drafter's children are drawn from its q without replacement
      and verified by recursive rejection sampling (True; None, the default: wherever the
      inner drafter expands), or are its k most probable tokens, walked (False). At T = 0 both
      are the k most probable. Measured on SmolLM2 at T = 1 (docs/BENCHMARKS.md, "Trees drawn
      from q at T > 0"): the same tree's τ +9-12.5%, and 6-11% faster.
    """

    k: int = dataclasses.field(metadata=dict(static=True), default=4)
    nodes: int = dataclasses.field(metadata=dict(static=True), default=16)
    width: int = dataclasses.field(metadata=dict(static=True), default=0)
    draft_temperature: float = dataclasses.field(metadata=dict(static=True), default=0.25)
    # T > 0: draw an expanding drafter's children from q (None: wherever the inner expands).
    draw: bool | None = dataclasses.field(metadata=dict(static=True), default=None)
    what = "a top-k tree"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.k, int) or self.k < 1:
            raise JspecError(f"top-k tree k must be an integer >= 1, got {self.k!r}")
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise JspecError(f"top-k tree nodes must be an integer >= 1, got {self.nodes!r}")
        if not isinstance(self.width, int) or not 0 <= self.width <= self.k:
            raise JspecError(f"top-k tree width must be an integer in [1, k = {self.k}] (0: k), "
                             f"got {self.width!r}")
        if self.draw not in (None, True, False):
            raise JspecError(f"top-k tree draw must be None, True or False, got {self.draw!r}")
        if self.draw and not self.inner.caps.expands:
            raise JspecError("top-k tree draw=1 draws the children of expanded nodes: it needs "
                             f"a drafter that expands trees (EAGLE-3), not {self.inner.name!r}")
        if not 0 < self.draft_temperature <= 1:
            raise JspecError("top-k tree draft_temperature must be in (0, 1], got "
                             f"{self.draft_temperature!r}")

    @property
    def expand_width(self) -> int:
        """Nodes expanded per level (0: the inner drafter cannot expand; chain-only tree)."""
        return (self.width or self.k) if self.inner.caps.expands else 0

    @property
    def caps(self) -> Capabilities:
        return self.inherited_caps(tree=True, nodes=functools.partial(
            tree_nodes, self.k, self.nodes, self.expand_width))

    def init_state(self, features: jax.Array | None, prompt_ids: jax.Array,
                   prompt_lengths: jax.Array, capacity: int, *, k: int,
                   verify_width: int | None = None) -> Any:
        # An expanding drafter keeps the tree's entries in (k - 1) * width slots past the
        # capacity (`expand_tree`). Paths are k tokens, or longer where a proposer around the
        # tree says so (`+ngram:look=L`).
        return self.inner.init_state(features, prompt_ids, prompt_lengths,
                                     capacity + (k - 1) * self.expand_width, k=k,
                                     verify_width=max(k, verify_width or k))

    def draft(self, state: Any, ctx: DraftContext, k: int, sampling: Sampling,
              key: jax.Array) -> tuple[Proposal, Any]:
        """The best `caps.lookahead(k)` nodes of a top-k tree of depth k."""
        n = self.caps.lookahead(k)
        if self.expand_width:
            drawn = {} if self.draw is False else dict(sampling=sampling, key=key)
            tokens, parents, q, state = self.inner.draft_tree(
                state, ctx, depth=k, k=self.k, width=self.expand_width, n=n, **drawn)
            return Proposal(tokens=tokens, parents=parents, q=q,
                            q_vocab=None if q is None else self.inner.q_vocab,
                            branching=self.k), state
        inner_sampling = Sampling(temperature=self.draft_temperature, top_k=self.k + 1)
        chain, state = self.inner.draft(state, ctx, k, inner_sampling, key)
        tokens, parents = top_k_tree(chain.tokens, chain.q, self.k, n, self.draft_temperature,
                                     q_vocab=chain.q_vocab)
        return Proposal(tokens=tokens, parents=parents, branching=self.k), state


# expand(carry, level, tokens i32[B, W], parent i32[B, W], anc bool[B, W, E])
#   -> (log-probabilities f32[B, W, Vd], carry)
Expand = Callable[[Any, int, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


def expand_tree(root_logp: jax.Array, vocab: jax.Array | None, expand: Expand, carry: Any, *,
                depth: int, k: int, width: int, n: int, key: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array | None, Any]:
    """An EAGLE-2-style token tree: `depth` levels, `width` nodes expanded per level, the `n`
    best candidates kept.

    Args:
      root_logp: f32[B, Vd] the drafter's log-probabilities of the first drafted token, over
        the target ids `vocab` i32[Vd] (None: all V).
      expand: one batched drafter step over the W nodes chosen at level l (1..depth-1): their
        tokens (target ids), `parent`: each one's index among the nodes expanded at level l - 1
        (0: the root, for l = 1), `anc`: the tree entries E = (depth - 1) * width it attends
        to (its expanded ancestors and itself; entry (l - 1) * width + i is node i of level
        l); returns its children's log-probabilities.
      carry: the drafter's state threaded through `expand`.
      key: None: each expanded node's k most probable children, the `n` best candidates by
        cumulative probability kept. A key (sampling, T > 0; `root_logp` and `expand` then give
        log q of the distribution tokens are drawn from): each expanded node's k children are
        drawn from its q without replacement (Gumbel-top-k, in draw order), and what is kept
        is the first n candidates in candidate order (level by level, the expanded nodes best
        first, each one's children in draw order) — a rule that never looks at a candidate's
        own token, so the children kept at a node are the first draws of it, which recursive
        rejection sampling needs (`jspec.verify.tree.verify_tree_drawn`).
    Returns:
      (tokens i32[B, n] (-1: empty), parents i32[B, n] (-1: `last`), q f32[B, n, Vd] per node
      the distribution it was drawn from (None without a key), carry), topological.
    """
    b = root_logp.shape[0]
    ids = (lambda ix: ix) if vocab is None else (lambda ix: vocab[ix])
    e_all = (depth - 1) * width
    keys = [None] * depth if key is None else list(jax.random.split(key, depth))

    def children(logp: jax.Array, key: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        if key is None:  # the k most probable
            return jax.lax.top_k(logp, k)
        logp = jnp.where(logp > NEG / 2, logp, -jnp.inf)  # filtered by top-k / top-p: q = 0
        _, ix = jax.lax.top_k(logp + jax.random.gumbel(key, logp.shape), k)  # k draws, in order
        return jnp.take_along_axis(logp, ix, axis=-1), ix

    lp, ix = children(root_logp, keys[0])  # [B, k] level 0 (depth 1)
    dists = [root_logp[:, None]]  # [B, 1 | W, Vd] the distributions children are drawn from
    f_dist = jnp.zeros((b, k), jnp.int32)  # index of the distribution a candidate was drawn from
    f_score, f_tok = lp, ids(ix).astype(jnp.int32)
    f_from = jnp.zeros((b, k), jnp.int32)  # the expanded node a candidate is a child of
    f_anc = jnp.zeros((b, k, e_all), bool)  # that node's entries (ancestors + itself)
    f_par = jnp.full((b, k), -1, jnp.int32)  # candidate index of the parent
    scores, toks, pars, levels = [f_score], [f_tok], [f_par], [jnp.zeros((b, k), jnp.int32)]
    from_dist = [f_dist]
    offset = 0  # candidate index of the frontier's first node
    for level in range(1, depth):
        s, sel = jax.lax.top_k(f_score, width)  # [B, W] the nodes to expand
        tok = jnp.take_along_axis(f_tok, sel, axis=1)
        parent = jnp.take_along_axis(f_from, sel, axis=1)
        own = jnp.arange(e_all) == (level - 1) * width + jnp.arange(width)[:, None]  # [W, E]
        anc = jnp.take_along_axis(f_anc, sel[..., None], axis=1) | own[None]
        logp, carry = expand(carry, level, tok, parent, anc)  # [B, W, Vd]
        lp, ix = children(logp, keys[level])  # [B, W, k]
        f_dist = jnp.broadcast_to((1 + (level - 1) * width + jnp.arange(width, dtype=jnp.int32)
                                   )[None, :, None], (b, width, k)).reshape(b, width * k)
        dists.append(logp)
        from_dist.append(f_dist)
        offset_next = offset + f_score.shape[1]
        f_score = (s[..., None] + lp).reshape(b, width * k)
        f_tok = ids(ix).astype(jnp.int32).reshape(b, width * k)
        f_from = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :, None],
                                  (b, width, k)).reshape(b, width * k)
        f_anc = jnp.repeat(anc, k, axis=1)
        f_par = jnp.repeat(offset + sel, k, axis=1).astype(jnp.int32)
        offset = offset_next
        scores.append(f_score)
        toks.append(f_tok)
        pars.append(f_par)
        levels.append(jnp.full((b, width * k), level, jnp.int32))
    cands = [jnp.concatenate(a, axis=1) for a in (scores, toks, pars, levels)]
    if key is None:
        tokens, parents = keep_best(*cands, n)
        return tokens, parents, None, carry
    score, tok, par = (a[:, :n] for a in cands[:3])
    # A child of an empty node scores -inf too (its score includes its parent's).
    tokens = jnp.where(jnp.isfinite(score), tok, -1).astype(jnp.int32)
    dist = jnp.concatenate(from_dist, axis=1)[:, :n]  # [B, n]
    logq = jnp.concatenate(dists, axis=1)  # [B, 1 + (depth - 1) W, Vd]
    q = jnp.exp(jnp.take_along_axis(logq, dist[..., None], axis=1))  # [B, n, Vd]
    return tokens, par.astype(jnp.int32), q, carry


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
    return keep_best(*(a.reshape(b, m) for a in (score, tok, parent_cand, level)), n)


def keep_best(score: jax.Array, tok: jax.Array, parent_cand: jax.Array, level: jax.Array,
              n: int) -> tuple[jax.Array, jax.Array]:
    """The n best candidates of a token tree by cumulative log-probability, as a proposal.

    Args:
      score: f32[B, M] cumulative draft log-probability of each candidate (-inf: none);
      tok: i32[B, M] its token; parent_cand: i32[B, M] its parent's candidate index (< its
      own; -1: `last`); level: i32[B, M] its depth - 1. A child scores at most its parent.
    Returns:
      (tokens i32[B, n] (-1: empty node), parents i32[B, n] (-1: `last`)) in candidate order,
      which is topological.
    """
    b = score.shape[0]
    m = score.shape[1]
    # Ties (q = 1 at a level) go to the shallower node, so a parent outranks its children.
    rank_key = jnp.where(jnp.isfinite(score), score, -1e30) - 1e-6 * level
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


def from_options(inner: Any, k: int = 4, nodes: int = 16, width: int = 0,
                 draw: int | None = None) -> TopKTree:
    """`load_drafter`'s `INNER+topk:k=K,nodes=N,width=W,draw=0|1` (draw not given: where the
    inner drafter expands)."""
    if draw not in (None, 0, 1):
        raise JspecError(f"+topk draw must be 0 or 1, got {draw!r}")
    return TopKTree(inner=inner, k=k, nodes=nodes, width=width,
                    draw=None if draw is None else bool(draw),
                    name=f"{getattr(inner, 'name', 'drafter')}+topk")
