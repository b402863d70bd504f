"""Tree verification: walk a proposed token tree along the target's own tokens.

At the current node take the target's token there (argmax at T = 0, a sample from the target's
processed distribution at T > 0) and move to the child holding that token; stop when no child
does. Emitted = the path's tokens + the target's token at the last path node. Every emitted
token is the target's own choice given the tokens before it, so the output is distributed
exactly as plain sampling from the target (greedy: identical), whatever the tree. One token per
node is pre-drawn with independent randomness; the path visits each node at most once, so this
is the same as drawing on the way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.models.llama import tree_ancestors
from jspec.sampling import Sampling, sample


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
                valid: jax.Array, target_logits: jax.Array, sampling: Sampling, max_depth: int
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`walk` with one target token per node drawn from `target_logits` f32[B, T, V] (the
    target forward over the tree's T nodes, root first). Returns (n, path, next token)."""
    target_tok = sample(key, target_logits, sampling)  # [B, T]
    return walk(tokens, parents, depth, valid, target_tok, max_depth)
