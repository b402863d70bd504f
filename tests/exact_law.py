"""Exact laws of one speculative round on a tiny vocabulary, computed by jspec's own code.

The target and the drafter are first-order Markov chains over V tokens: after token a the
target's next-token logits are A[a] and the drafter's D[a] (a block drafter: `S` tables, one per
drafted slot, each slot anchored on its block's first token's predecessor). A round starts after
token `root`. Every outcome of the round is enumerated, weighted by its exact probability:

- the drafted tokens: every draft is one row of a batch, weighted by its probability in float64
  (a chain: the product of its q's; a drawn tree: each expanded node's children are an ordered
  draw without replacement, sum_i log q(c_i) - log q(untried) — what Gumbel-top-k draws). A
  tree is built by jspec's real `expand_tree`, its Gumbel noise replaced by noise that forces
  the row's draw order (the noise is the only thing substituted); LibraSpec's lengths come from
  the real `libraspec_draft` over a drafter that reads each row's tokens from the enumeration;
- acceptance: the real `decide_chain` / `walk_drawn` with forced uniforms per acceptance
  pattern (0: accept whenever p > 0, inf: reject), weighted by the product of the `prob` =
  min(1, p/q) they return (accepted) and 1 − prob (rejected): the probability that uniforms
  u ~ U[0, 1) take the same decisions, since the code accepts iff u·q < p;
- the next token: the distribution the real code returns (the residual, or p), normalised in
  float64.

Not exercised: jax.random's uniforms and Gumbel noise, and the Gumbel-max draw from the final
distribution (`jspec.sampling.categorical`, tests/test_sampling.py). The law of the emitted
tokens, completed with the target's own law for the positions the round did not reach, is
compared with the target's law of the next L tokens in float64 (total variation distance).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters.base import Capabilities, DraftContext, Proposal
from jspec.drafters.topk_tree import expand_tree
from jspec.length import LibraSpec, libraspec_draft
from jspec.sampling import Sampling, process_logits
from jspec.verify.lossless import decide_chain
from jspec.verify.tree import walk_drawn

ACCEPT, REJECT = 0.0, float("inf")  # forced uniforms: u·q < p holds iff p > 0 / never


# ------------------------------------------------------------------------------ float64 laws
def log_probs64(logits: np.ndarray, t: float) -> np.ndarray:
    """f64[..., V]: log softmax(logits / t) in float64."""
    z = np.asarray(logits, np.float64) / t
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def order_log_prob(logq: np.ndarray, order: np.ndarray) -> np.ndarray:
    """f64[R]: log-probability of drawing `order` i64[R, k] in that order without replacement
    from exp(logq) (f64[R, V]): each draw's log q minus the log of the untried mass, computed
    over the untried tokens (never as 1 − the tried mass, which cancels at low T)."""
    untried = np.ones(logq.shape, bool)
    out = np.zeros(logq.shape[0])
    rows = np.arange(logq.shape[0])
    for i in range(order.shape[1]):
        masked = np.where(untried, logq, -np.inf)
        top = masked.max(-1)
        out += logq[rows, order[:, i]] - top - np.log(np.exp(masked - top[:, None]).sum(-1))
        untried[rows, order[:, i]] = False
    return out


def extend(law: np.ndarray, p: np.ndarray, steps: int) -> np.ndarray:
    """A law over token sequences f64[V]*m extended by `steps` tokens of the Markov chain p."""
    for _ in range(steps):
        law = law[..., None] * p
    return law


def target_law(a: np.ndarray, root: int, length: int, t: float) -> np.ndarray:
    """f64[V]*length: the target's law of the next `length` tokens after `root`."""
    p = np.exp(log_probs64(a, t))
    return extend(p[root], p, length - 1)


class Outcomes:
    """Weighted outcomes of a round: emitted prefix tokens, then a next-token distribution."""

    def __init__(self, v: int):
        self.v = v
        self.by_len: dict[int, np.ndarray] = {}  # m -> f64[V]*m mass of emitted m tokens
        self.total = 0.0

    def add(self, prefix: np.ndarray, weight: np.ndarray, dist: np.ndarray) -> None:
        """prefix i64[R, m-1], weight f64[R], dist f32[R, V] (unnormalised) of the m-th token."""
        keep = weight > 0
        prefix, weight = prefix[keep], weight[keep]
        dist = np.asarray(dist, np.float64)[keep]
        mass = weight[:, None] * dist / dist.sum(-1, keepdims=True)
        m = prefix.shape[1] + 1
        arr = self.by_len.setdefault(m, np.zeros((self.v,) * m))
        if m == 1:
            arr += mass.sum(0)
        else:
            np.add.at(arr, tuple(prefix.T), mass)
        self.total += float(weight.sum())

    def completed(self, p: np.ndarray, length: int) -> np.ndarray:
        """f64[V]*length: the emitted tokens' law, completed by the Markov chain p."""
        return sum(extend(arr, p, length - m) for m, arr in self.by_len.items())


def total_variation(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


def patterns(levels: int, m: int) -> np.ndarray:
    """i64[P, levels]: per level the child accepted (0..m-1) or m (every child rejected)."""
    return np.asarray(list(itertools.product(range(m + 1), repeat=levels)), np.int64).reshape(
        -1, levels)


def forced_uniforms(j: np.ndarray, m: int) -> np.ndarray:
    """f32[R, m] per row: REJECT before child j[r], ACCEPT at it, REJECT after."""
    i = np.arange(m)[None]
    return np.where(i == j[:, None], ACCEPT, REJECT).astype(np.float32)


def pattern_weight(prob: np.ndarray, j: np.ndarray) -> np.ndarray:
    """f64[R]: the probability of "reject children < j, accept child j" (j = m: reject all)
    from prob f32[R, m] = min(1, p/q) of each child tried (0 for none)."""
    prob = np.asarray(prob, np.float64)
    m = prob.shape[1]
    i = np.arange(m)[None]
    rej = np.prod(np.where(i < j[:, None], 1.0 - prob, 1.0), axis=1)
    acc = np.where(j < m, prob[np.arange(len(j)), np.minimum(j, m - 1)], 1.0)
    return rej * acc


# --------------------------------------------------------------------------------- chains
_decide_chain = jax.jit(decide_chain, static_argnames="sampling")


def chain_outcomes(a: np.ndarray, root: int, drafts: np.ndarray, q: jax.Array,
                   weights: np.ndarray, valid: np.ndarray, sampling: Sampling) -> Outcomes:
    """Every acceptance pattern of the real `decide_chain` over drafted chains.

    drafts i64[R, K], q f32[R, K, V] (what the drafter reports), weights f64[R] (each draft's
    probability), valid bool[R, K] (slots verified)."""
    r, k = drafts.shape
    j = np.repeat(np.arange(k + 1), r)  # pattern j: accept slots < j, reject slot j
    rows = np.tile(np.arange(r), k + 1)
    u = np.where(np.arange(k)[None] < j[:, None], ACCEPT, REJECT).astype(np.float32)
    ctx = np.concatenate([np.full((r, 1), root), drafts], axis=1)
    n, dist, prob = _decide_chain(jnp.asarray(u), jnp.asarray(drafts[rows], jnp.int32),
                                  q[rows], jnp.asarray(a[ctx[rows]], jnp.float32), sampling,
                                  jnp.asarray(valid[rows]))
    n, dist, prob = (np.asarray(x) for x in (n, dist, prob))
    # Pattern j: slots < j accepted, slot j rejected (the bonus slot K: "rejected" surely).
    prob = np.concatenate([prob, np.zeros((len(rows), 1), prob.dtype)], axis=1).astype(float)
    below = np.arange(k + 1)[None] < j[:, None]
    w = (weights[rows] * np.prod(np.where(below, prob, 1.0), axis=1)
         * (1.0 - prob[np.arange(len(rows)), j]))
    assert (n[w > 0] == j[w > 0]).all(), "forced uniforms did not realise their pattern"
    out = Outcomes(a.shape[0])
    for m in range(k + 1):
        sel = j == m
        out.add(drafts[rows[sel], :m], w[sel], dist[sel])
    return out


def chain_law(a: np.ndarray, d: np.ndarray, root: int, k: int, t: float) -> tuple[float, float]:
    """(TV from the target's law of k + 1 tokens, total weight) of a K-token chain round:
    drafts drawn from the Markov drafter D, verified by the real `decide_chain` with the q rows
    jspec's processing gives (softmax(process_logits(D[prev])) in float32)."""
    v = a.shape[0]
    s = Sampling(temperature=t)
    drafts = np.asarray(list(itertools.product(range(v), repeat=k)), np.int64)
    prev = np.concatenate([np.full((len(drafts), 1), root), drafts[:, :-1]], axis=1)
    lq = log_probs64(d, t)
    weights = np.exp(lq[prev, drafts].sum(1))
    q = jax.nn.softmax(process_logits(jnp.asarray(d[prev], jnp.float32), s), axis=-1)
    out = chain_outcomes(a, root, drafts, q, weights, np.ones(drafts.shape, bool), s)
    p = np.exp(log_probs64(a, t))
    return total_variation(out.completed(p, k + 1), target_law(a, root, k + 1, t)), out.total


# ----------------------------------------------------------------------------- drawn trees
def _forcing_noise(orders: np.ndarray, v: int) -> np.ndarray:
    """f32[..., V] noise that makes top_k(log q + noise) return `orders` i64[..., k] in order
    (log q of a processed row lies within [-1e3, 0]: gaps of 1e4 dominate it)."""
    k = orders.shape[-1]
    g = np.zeros((*orders.shape[:-1], v), np.float32)
    np.put_along_axis(g, orders, (1e4 * (k - np.arange(k))).astype(np.float32), axis=-1)
    return g


_walk = jax.jit(walk_drawn, static_argnames="max_depth")


def drawn_tree_law(a: np.ndarray, d: np.ndarray, root: int, t: float, depth: int, k: int,
                   width: int = 1, nodes: int | None = None,
                   q_of: Callable[[jax.Array], jax.Array] = lambda q: q) -> tuple[float, float]:
    """(TV from the target's law of depth + 1 tokens, total weight) of one round of a tree
    drawn by the real `expand_tree` (k children per expanded node, `width` nodes expanded per
    level, the first `nodes` candidates kept) and verified by the real `walk_drawn`.
    `q_of`: what the verifier is given in place of the tree's q (a broken variant)."""
    v = a.shape[0]
    s = Sampling(temperature=t)
    logq32 = jax.nn.log_softmax(process_logits(jnp.asarray(d, jnp.float32), s), axis=-1)
    lq = log_probs64(d, t)
    perms = np.asarray(list(itertools.permutations(range(v), k)), np.int64)  # [P, k]
    levels = [perms] + [perms] * ((depth - 1) * width)
    grid = np.stack(np.meshgrid(*[np.arange(len(x)) for x in levels], indexing="ij"),
                    -1).reshape(-1, len(levels))  # [R, 1 + (depth-1) W]: a draw order per node
    r = len(grid)
    orders = [perms[grid[:, 0]]]
    orders += [perms[grid[:, 1 + (lvl - 1) * width:1 + lvl * width]] for lvl in range(1, depth)]
    noise = iter([_forcing_noise(o, v) for o in orders])
    expanded: list[np.ndarray] = []

    def gumbel(key, shape, *args, **kw):
        g = next(noise)
        assert g.shape == tuple(shape), (g.shape, shape)
        return jnp.asarray(g)

    def expand(carry, level, tok, parent, anc):
        expanded.append(np.asarray(tok))
        return logq32[tok], carry

    root_logp = jnp.broadcast_to(logq32[root], (r, v))
    with mock.patch.object(jax.random, "gumbel", gumbel):
        tokens, parents, q, _ = expand_tree(root_logp, None, expand, None, depth=depth, k=k,
                                            width=width, n=nodes or k * (1 + (depth - 1) * width),
                                            key=jax.random.key(0))
    logw = order_log_prob(np.broadcast_to(lq[root], (r, v)), orders[0])
    for lvl in range(1, depth):
        for w in range(width):
            logw += order_log_prob(lq[expanded[lvl - 1][:, w]], orders[lvl][:, w])
    weights = np.exp(logw)

    toks = np.concatenate([np.full((r, 1), root), np.asarray(tokens)], axis=1)
    par = np.concatenate([np.full((r, 1), -1), np.asarray(parents) + 1], axis=1)
    q_full = jnp.pad(q_of(q), ((0, 0), (1, 0), (0, 0)))
    pat = patterns(depth, k)  # the last level's nodes are leaves: every child rejected
    rows = np.repeat(np.arange(r), len(pat))
    jj = np.tile(pat, (r, 1))  # [R P, depth]
    u = np.stack([forced_uniforms(jj[:, lvl], k) for lvl in range(depth)]
                 + [np.full((len(rows), k), REJECT, np.float32)])
    p_all = jax.nn.softmax(process_logits(jnp.asarray(a[np.maximum(toks, 0)], jnp.float32), s),
                           axis=-1)
    n, path, p_stop, prob = _walk(jnp.asarray(u), jnp.asarray(toks[rows], jnp.int32),
                                  jnp.asarray(par[rows], jnp.int32),
                                  jnp.asarray(toks[rows] >= 0), p_all[rows], q_full[rows], None,
                                  max_depth=depth)
    n, path, p_stop, prob = (np.asarray(x) for x in (n, path, p_stop, prob))
    w = weights[rows]
    for lvl in range(depth):
        w = w * pattern_weight(prob[lvl], jj[:, lvl])
    out = Outcomes(v)
    emitted = np.take_along_axis(toks[rows], path[:, 1:], axis=1)  # [R P, depth]
    for m in range(depth + 1):
        sel = n == m
        out.add(emitted[sel, :m], w[sel], p_stop[sel])
    p = np.exp(log_probs64(a, t))
    return (total_variation(out.completed(p, depth + 1), target_law(a, root, depth + 1, t)),
            out.total)


# ------------------------------------------------------------------------------- LibraSpec
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EnumeratedBlockDrafter:
    """A block drafter whose rows' tokens are given (one enumerated draft per row): slot s of
    a block anchored on token b has q = softmax(process_logits(table[s, b])) (float32) and
    confidence max q — fixed before the slot's token, as jspec's drafters report it."""

    seqs: jax.Array  # i32[R, S] every row's token at every slot
    logits: jax.Array  # f32[S, V, V]
    block: int = dataclasses.field(metadata=dict(static=True))
    t: float = dataclasses.field(metadata=dict(static=True))

    @property
    def caps(self) -> Capabilities:
        return Capabilities(block_tokens=self.block)

    def _slots(self, anchor, offset, k):
        logits = jnp.moveaxis(self.logits[offset:offset + k][:, anchor], 0, 1)  # [R, k, V]
        q = jax.nn.softmax(process_logits(logits, Sampling(temperature=self.t)), axis=-1)
        return self.seqs[:, offset:offset + k], q, jnp.max(q, axis=-1)

    def draft(self, state, ctx, k, sampling, key):
        tok, q, conf = self._slots(ctx.last, 0, k)
        return Proposal(tokens=tok, q=q, conf=conf), state

    def extend(self, state, ctx, anchor, offset, sampling, key):
        return self._slots(anchor, offset, self.block)


_libraspec_draft = jax.jit(libraspec_draft, static_argnums=(0, 4))


def libraspec_law(a: np.ndarray, table: np.ndarray, root: int, t: float, policy: LibraSpec,
                  block: int, floor: bool = True) -> tuple[float, float, np.ndarray]:
    """(TV from the target's law of d_max + 1 tokens, total weight, the lengths chosen) of one
    LibraSpec round: every draft of the block drafter over `table` f32[S, V, V] (S: the slots
    `libraspec_draft` may draft), lengths from the real `libraspec_draft`, verified by the real
    `decide_chain`. Slots past d_max are never verified and no length reads their tokens: they
    hold token 0 (their draws sum out). `floor=False` runs the length rule as it runs for greedy
    tokens (no floor: the broken variant; the drafter's q and tokens are unchanged)."""
    v, total, dm = a.shape[0], table.shape[0], policy.d_max
    k1 = min(policy.n, block)
    assert total == k1 + -(-(dm - k1) // block) * block, "one table per slot"
    drafts = np.asarray(list(itertools.product(range(v), repeat=dm)), np.int64)
    r = len(drafts)
    seqs = np.pad(drafts, ((0, 0), (0, total - dm)))
    anchor_slot = np.asarray([-1 if s < k1 else k1 + (s - k1) // block * block - 1
                              for s in range(dm)])
    anchors = np.where(anchor_slot[None] < 0, root, drafts[:, np.maximum(anchor_slot, 0)])
    lq = log_probs64(table[:dm], t)  # [d_max, V, V]
    weights = np.exp(lq[np.arange(dm)[None], anchors, drafts].sum(1))
    drafter = EnumeratedBlockDrafter(jnp.asarray(seqs, jnp.int32),
                                     jnp.asarray(table, jnp.float32), block, t)
    s = Sampling(temperature=t)
    ctx = DraftContext(seq=jnp.zeros((r, 1), jnp.int32), cache_len=jnp.zeros((r,), jnp.int32),
                       last=jnp.full((r,), root, jnp.int32))
    prop, _, length, _ = _libraspec_draft(policy, drafter, None, ctx,
                                          s if floor else Sampling(), jax.random.key(0),
                                          jnp.ones((r,), bool))
    length = np.asarray(length)
    valid = np.arange(dm)[None] < length[:, None]
    # A block no row's length reaches is not drafted (zeros): only verified slots must agree.
    np.testing.assert_array_equal(np.where(valid, np.asarray(prop.tokens), drafts), drafts)
    out = chain_outcomes(a, root, drafts, prop.q, weights, valid, s)
    p = np.exp(log_probs64(a, t))
    tv = total_variation(out.completed(p, dm + 1), target_law(a, root, dm + 1, t))
    return tv, out.total, length
