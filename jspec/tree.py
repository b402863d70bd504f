"""Tree speculative rounds (D²SD): draft a prefix tree -> one target forward -> walk -> commit.

The drafter (`jspec.drafters.d2sd.D2SD`) proposes a tree of T nodes per row: node 0 is `last`
(the anchor), every other node a drafted token with a parent (`TreeDraft`). One target forward
runs over all T nodes with the tree attention mask (`Tree(parents)`: each node sees the
committed cache, its ancestors and itself) at position cache_len + depth.

Acceptance walks the tree: at the current node take the target's token there (argmax at T=0,
a sample from the target's processed distribution at T>0) and move to the child holding that
token; stop when no child does. Emitted = the path's tokens + the target's token at the last
path node. Every emitted token is the target's own choice given the tokens before it, so the
output is distributed exactly as plain sampling from the target (greedy: identical). One token
per node is pre-drawn with independent randomness; the path visits each node at most once, so
this is the same as drawing on the way.

Commit: the path's K/V sit in the slots the tree forward wrote (cache_len + node index), which
are not contiguous; they are moved to cache_len + depth (1..n) in every layer, then lengths are
updated as in `decode.commit`. The drafters get the target features of the path nodes.

Stats: `accepted` = path length n (tokens beyond `last` accepted), `emitted` = n + 1 per round
(τ = emitted / rounds, as for chains), `drafted` = T - 1 tree nodes verified per round,
`accepted_at[d]` counts rounds whose path reached depth d + 1.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters.base import DraftContext
from jspec.drafters.d2sd import tree_layout
from jspec.models.cache import KVCache
from jspec.models.config import ModelConfig
from jspec.models.llama import Tree, Weights, forward, tree_ancestors
from jspec.sampling import Sampling, sample
from jspec.state import SpecState, commit, feature_layers, features


def is_tree_drafter(drafter: Any) -> bool:
    """Drafters that propose trees (`propose_tree`) run `tree_round`."""
    return bool(getattr(drafter, "is_tree", False))


def walk(tokens: jax.Array, parents: jax.Array, depth: jax.Array, valid: jax.Array,
         target_tok: jax.Array, max_depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Walk a drafted tree along the target's tokens.

    Args:
      tokens: i32[B, T] node tokens (node 0 the root); parents: i32[B, T] (parents[t] < t,
        -1 for the root); depth: i32[B, T]; valid: bool[B, T].
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


def compact_path(cache: KVCache, start: jax.Array, path: jax.Array) -> KVCache:
    """Move the K/V of path nodes (written at slots start + node) to slots start + depth.

    Args:
      start: i32[B] the slot of node 0 (the committed length before the round).
      path: i32[B, D+1] node at each depth (path[:, 0] = 0 stays in place).
    """
    b, d1 = path.shape
    rows = jnp.arange(b)[:, None]
    src = start[:, None] + path[:, 1:]  # [B, D]
    dst = start[:, None] + jnp.arange(1, d1, dtype=jnp.int32)[None]
    ks = tuple(c.at[rows, :, dst].set(c[rows, :, src], mode="drop") for c in cache.k)
    vs = tuple(c.at[rows, :, dst].set(c[rows, :, src], mode="drop") for c in cache.v)
    return dataclasses.replace(cache, k=ks, v=vs)


def tree_round(config: ModelConfig, weights: Weights, drafter: Any, state: SpecState, *,
               k: int, sampling: Sampling, eos_ids: tuple[int, ...], verifier: Any = None
               ) -> SpecState:
    """draft a tree -> one target forward over its T nodes -> walk -> commit the path.

    The walk is the verifier: `generate` admits only a verifier that `supports.trees`."""
    key, k_draft, k_verify = jax.random.split(state.key, 3)
    cache = state.cache
    ctx = DraftContext(seq=state.seq, cache_len=cache.lengths, last=state.last)
    with jax.named_scope("draft"):
        tree, dstate = drafter.propose_tree(state.drafter, ctx, k, k_draft)
    fl = feature_layers(drafter)
    with jax.named_scope("verify"):
        pos = cache.lengths[:, None] + tree.depth
        out = forward(config, weights, tree.tokens, pos, cache, mask=Tree(tree.parents),
                      hidden_layers=fl)
    with jax.named_scope("accept"):
        # One target token per node, drawn independently (argmax when greedy).
        target_tok = sample(k_verify, out.logits, sampling)  # [B, T]
        n, path, nxt = walk(tree.tokens, tree.parents, tree.depth, tree.valid, target_tok, k)
    with jax.named_scope("commit"):
        new_cache = compact_path(out.cache, cache.lengths, path)
        if fl:
            f = features(out.hidden, drafter)  # [B, T, F, D]
            f = jnp.take_along_axis(f, path[:, :, None, None], axis=1)  # [B, k+1, F, D]
            dstate = drafter.observe(dstate, f, cache.lengths, n + 1)
        path_tok = jnp.take_along_axis(tree.tokens, path[:, 1:], axis=1)  # [B, k]
        rows = jnp.arange(n.shape[0])
        emitted = jnp.concatenate([path_tok, jnp.zeros_like(nxt)[:, None]], axis=1)
        emitted = emitted.at[rows, n].set(nxt)
        state = commit(state, emitted, n + 1, eos_ids, new_cache, n, tree.tokens.shape[1] - 1)
    return dataclasses.replace(state, key=key, drafter=dstate)


def verify_cost(model: Any, drafter: Any, k: int, fill: int = 400, repeats: int = 5
                ) -> dict[str, float]:
    """c(tree) = t(target forward over the T-node tree) / t(1-token forward), host-side.

    Measured like `bench.cost_curve`'s c(K): batch 1, `fill` tokens already cached, float32,
    median of `repeats` after a warm-up, the tree being `drafter`'s layout for chain length k
    (boundaries 0..K-1; the cost does not depend on which).
    """
    cfg = model.config
    n_br = drafter.num_branches(k)
    parents, depth, _ = tree_layout(k, n_br, drafter.branch_len,
                                    jnp.arange(n_br, dtype=jnp.int32)[None])
    t = parents.shape[1]
    cap = -(-(fill + t + 1) // 128) * 128

    @jax.jit
    def fwd(w, toks, pos, cache, parents):
        out = forward(cfg, w, toks, pos, cache, mask=Tree(parents))
        return out.logits, out.cache

    def timed(toks, pos, par):
        cache = KVCache.create(cfg, 1, cap).with_lengths(jnp.array([fill], jnp.int32))
        jax.block_until_ready(fwd(model.weights, toks, pos, cache, par))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fwd(model.weights, toks, pos, cache, par))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    one = timed(jnp.full((1, 1), 42, jnp.int32), jnp.array([[fill]], jnp.int32),
                jnp.full((1, 1), -1, jnp.int32))
    tree = timed(jnp.full((1, t), 42, jnp.int32), fill + depth, parents)
    return {"nodes": t, "ms_1": 1000 * one, "ms_tree": 1000 * tree, "c": tree / one}
