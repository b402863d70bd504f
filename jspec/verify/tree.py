"""Tree verification: walk a proposed token tree along the target's own tokens.

At the current node take the target's token there (argmax at T = 0, a sample from the target's
processed distribution at T > 0) and move to the child holding that token; stop when no child
does. Emitted = the path's tokens + the target's token at the last path node. Every emitted
token is the target's own choice given the tokens before it, so the output is distributed
exactly as plain sampling from the target (greedy: identical), whatever the tree. One token per
node is pre-drawn with independent randomness; the path visits each node at most once, so this
is the same as drawing on the way.

A tree whose children were drawn from the drafter's q at T > 0 (`+topk:...,draw=1`) carries
that q and is verified by recursive rejection sampling instead (`verify_tree_drawn`): a child
is accepted with min(1, p/q) of the residual, not only when the target's own sample equals it,
which is the walk's rule for deterministic children and the degenerate case of the same
procedure (q one-hot at the child).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models.llama import tree_ancestors
from jspec.sampling import (
    Sampling,
    dense_q,
    one_hot_where_deterministic,
    process_logits,
    sample,
    sample_from_probs,
)
from pallas_kernels.relaxed_acceptance.decide import RESIDUAL_EPS, accept_sampled

_TINY = float(np.finfo(np.float32).tiny)  # float32's smallest normal, 1.2e-38


def walk(tokens: jax.Array, parents: jax.Array, depth: jax.Array, valid: jax.Array,
         target_tok: jax.Array, max_depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Walk a drafted tree along the target's tokens.

    Args:
      tokens: i32[B, T] node tokens (node 0 the root, `last`); parents: i32[B, T] (parents[t] <
        t, -1 for the root); depth: i32[B, T]; valid: bool[B, T].
      target_tok: i32[B, T] the target's token at each node (what follows the node).
      max_depth: static maximum depth of a node.
    Returns:
      (n i32[B] path length (accepted drafted tokens), path i32[B, max_depth + 1] node at each
      depth (path[:, 0] = 0; 0 beyond n), next token i32[B] = the target's token at path[n]).
    """
    t = tokens.shape[1]
    par_tok = jnp.take_along_axis(target_tok, jnp.maximum(parents, 0), axis=1)
    raw = valid & (tokens == par_tok) & (parents >= 0)
    # At most one matching child per node: the first in node order (siblings normally hold
    # distinct tokens; this keeps the walk well defined when they do not).
    idx = jnp.arange(t)
    same_parent = parents[:, :, None] == parents[:, None, :]  # [B, T(u), T(v)]
    earlier = (idx[None, :] < idx[:, None])[None]  # v < u
    dup = jnp.any(same_parent & earlier & raw[:, None, :], axis=2)
    matched = (raw & ~dup) | (idx[None] == 0)
    anc = tree_ancestors(parents)  # [B, T, T]: anc[u, v]: v is u or an ancestor of u
    on_path = ~jnp.any(anc & ~matched[:, None, :], axis=2)
    n = jnp.sum(on_path, axis=1).astype(jnp.int32) - 1
    at = on_path[:, None, :] & (depth[:, None, :] == jnp.arange(max_depth + 1)[None, :, None])
    path = jnp.sum(jnp.where(at, idx[None, None, :], 0), axis=2).astype(jnp.int32)
    last_node = jnp.take_along_axis(path, n[:, None], axis=1)[:, 0]
    nxt = jnp.take_along_axis(target_tok, last_node[:, None], axis=1)[:, 0]
    return n, path, nxt


def verify_tree(key: jax.Array, tokens: jax.Array, parents: jax.Array, depth: jax.Array,
                valid: jax.Array, target_logits: jax.Array, sampling: Sampling, max_depth: int,
                q: jax.Array | None = None, q_vocab: jax.Array | None = None,
                max_children: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Verify a tree from the target forward `target_logits` f32[B, T, V] over its T nodes,
    root first. Deterministic children (q None, or greedy): `walk` with one target token per
    node drawn from the logits. Children drawn from q f32[B, T, Vq] at T > 0:
    `verify_tree_drawn` (`max_children` static, 0: T - 1). Returns (n, path, next token)."""
    if q is not None and not sampling.greedy:
        return verify_tree_drawn(key, tokens, parents, valid, target_logits, sampling,
                                 max_depth, q, q_vocab, max_children or tokens.shape[1] - 1)
    target_tok = sample(key, target_logits, sampling)  # [B, T]
    return walk(tokens, parents, depth, valid, target_tok, max_depth)


def verify_tree_drawn(key: jax.Array, tokens: jax.Array, parents: jax.Array, valid: jax.Array,
                      target_logits: jax.Array, sampling: Sampling, max_depth: int,
                      q: jax.Array, q_vocab: jax.Array | None, max_children: int
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Recursive rejection sampling down a tree whose children were drawn from q (T > 0).

    At the current node u (the root first) with target distribution p (after `sampling`'s
    processing), its children c_1, c_2, ... are tried in node order: c_i is accepted with
    probability min(1, p(c_i) / q_i(c_i)), where q_i is the distribution c_i was drawn from —
    its q row with the tokens already tried at u removed and renormalised (children drawn from
    one q without replacement, in node order) — and on a rejection p becomes the residual
    norm([p − q_i]+). An accepted child becomes the current node; when every child is rejected
    (or there is none) the next token is drawn from the residual p, and the walk stops. Each
    step's output is distributed as p, so every emitted token is the target's (Chen et al.'s
    speculative sampling applied recursively; for children drawn without replacement, Jeon et
    al. 2024, "Recursive Speculative Decoding").

    A child whose q_i gives its own token no mass is verified as q_i one-hot at it: accepted with
    p(c_i), and on a rejection p loses c_i. That is exact whatever proposed c_i (conditional on
    any proposed token the emitted one is distributed as p), so it covers a deterministic child
    (a top-k child at T = 0, a looked-up token: a tree of those is verified as the walk would),
    a repeated token, and a child drawn from q whose probability underflowed float32: children
    are drawn from log q, which does not underflow, so a tail draw at low temperature can carry
    q_i(c_i) = 0 (an entry below float32's smallest normal, 1.2e-38, counts as 0). Such a child
    is still verified exactly. Given that c_i is one of the tokens q_i gives mass, it is
    distributed as q_i (the draw renormalised over them), and the usual rule emits law p on
    that event; given that it is one of the others, the one-hot rule emits law p. No mass is
    lost to the underflow (it is the second event); what is left is float32 rounding of q_i's
    entries (tests/test_exact_law.py: total variation ≤ 3e-7 at T = 0.05..1).

    Args:
      tokens, parents, valid: as in `walk` (node 0 the root).
      target_logits: f32[B, T, V] the target forward over the T nodes.
      q: f32[B, T, Vq] per node the draft distribution it was drawn from (its parent's q;
        row 0 unused), over the target ids `q_vocab` i32[Vq] (None: all V).
      max_children: static bound on the children of a node (tried per level).
    Returns:
      (n i32[B], path i32[B, max_depth + 1], next token i32[B]) as `walk`.
    """
    t = tokens.shape[1]
    m = max(1, min(max_children, t - 1))
    p_all = jax.nn.softmax(process_logits(target_logits, sampling), axis=-1)  # [B, T, V]
    k_u, k_s = jax.random.split(key)
    uniforms = jax.random.uniform(k_u, (max_depth + 1, tokens.shape[0], m))
    n, path, p_stop, _ = walk_drawn(uniforms, tokens, parents, valid, p_all, q, q_vocab,
                                    max_depth)
    # One draw per row from the residual it stopped at, not one per level (each draw is
    # Gumbel noise over V: ~0.5 ms for 49,152 tokens on a 2-core CPU).
    return n, path, sample_from_probs(k_s, p_stop)


def walk_drawn(uniforms: jax.Array, tokens: jax.Array, parents: jax.Array, valid: jax.Array,
               p_all: jax.Array, q: jax.Array, q_vocab: jax.Array | None, max_depth: int
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`verify_tree_drawn`'s decisions for given uniforms.

    Args:
      uniforms: f32[max_depth + 1, B, m] one per level and child tried (m children at most
        per node); `verify_tree_drawn` draws them from its key. Child i is accepted iff
        u·q_i(c_i) < p(c_i): u = 0 accepts it whenever p(c_i) > 0, u = inf rejects it.
      tokens, parents, valid, q, q_vocab, max_depth: as in `verify_tree_drawn`.
      p_all: f32[B, T, V] the target's processed distribution at each node.
    Returns:
      (n i32[B], path i32[B, max_depth + 1], p_stop f32[B, V] the residual each row stops at
      (the next token is drawn from it), prob f32[max_depth + 1, B, m] min(1, p(c_i)/q_i(c_i))
      of each child tried, 0 for a child not tried). An exact enumeration
      (tests/exact_law.py) runs the forced uniforms 0 / inf and integrates `prob`.
    """
    b, t = tokens.shape
    v = p_all.shape[-1]
    m = uniforms.shape[-1]
    rows = jnp.arange(b)
    idx = jnp.arange(t, dtype=jnp.int32)
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    n = jnp.zeros((b,), jnp.int32)
    p_stop = jnp.zeros((b, v), jnp.float32)  # the residual each row stops at
    path = jnp.zeros((b, max_depth + 1), jnp.int32)
    probs = []
    for level in range(max_depth + 1):
        u_level = uniforms[level]
        p = p_all[rows, cur]  # [B, V]
        child = valid & (parents == cur[:, None]) & (idx > 0)[None]
        # The first m children in node order (their draw order).
        order, cidx = jax.lax.top_k(jnp.where(child, -idx[None], -t), m)
        has = order > -t  # [B, m]
        tried = jnp.zeros((b, v), bool)
        taken = jnp.zeros((b,), bool)
        to = jnp.zeros((b,), jnp.int32)
        for i in range(m):
            c = cidx[:, i]
            ok = has[:, i] & alive & ~taken
            tok = jnp.take_along_axis(tokens, c[:, None], axis=1)[:, 0]
            hot = jnp.arange(v, dtype=jnp.int32)[None] == tok[:, None]  # [B, V]
            # q_i: the row without the tokens already tried here, renormalised. The tried
            # tokens go first, so a child with no mass left (deterministic, repeated, or a
            # tail draw whose q underflowed) is one-hot, and Σr ≥ r(c_i) > 0 needs no guard
            # (a clamp there once left a row with 1.2e-38 < Σr < 1e-30 unnormalised: tail
            # children accepted almost surely). Entries below float32's smallest normal count
            # as none: XLA:CPU flushes them anyway, and on a backend that keeps subnormals
            # their few bits, divided by a tiny Σr, would misstate q_i.
            r = dense_q(q[rows, c], q_vocab, v)
            r = one_hot_where_deterministic(jnp.where(tried | (r < _TINY), 0.0, r), tok)
            r = r / jnp.sum(r, axis=-1, keepdims=True)
            q_x = jnp.sum(jnp.where(hot, r, 0.0), axis=-1)
            p_x = jnp.sum(jnp.where(hot, p, 0.0), axis=-1)
            n_i, _, _, prob = accept_sampled(ok[:, None], u_level[:, i:i + 1], q_x[:, None],
                                             p_x[:, None])
            acc = n_i == 1
            probs.append(prob[:, 0])
            rej = ok & ~acc
            resid = jnp.maximum(p - r, 0.0)
            mass = jnp.sum(resid, axis=-1, keepdims=True)
            # A numerically empty residual keeps p (as `verify_chain`'s residual draw does:
            # an error of at most RESIDUAL_EPS, the probability of that rejection).
            upd = rej[:, None] & (mass > RESIDUAL_EPS)
            p = jnp.where(upd, resid / jnp.where(upd, mass, 1.0), p)
            tried = tried | (ok[:, None] & hot)
            to = jnp.where(acc, c, to)
            taken = taken | acc
        p_stop = jnp.where((alive & ~taken)[:, None], p, p_stop)
        move = alive & taken
        n = n + move.astype(jnp.int32)
        if level < max_depth:
            path = path.at[:, level + 1].set(jnp.where(move, to, 0))
        cur = jnp.where(move, to, cur)
        alive = move
    return n, path, p_stop, jnp.stack(probs).reshape(max_depth + 1, m, b).transpose(0, 2, 1)
