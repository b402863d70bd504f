"""The shape of a round's proposal, and every step of a round that depends on it.

A proposal is a tree of N drafted nodes after `last`; a chain is the degenerate tree whose node
t has parent t - 1 (`Topology.parents` None, verified with the causal mask). `Topology` is what
`jspec.rounds.speculative_round` asks instead of forking on chain-or-tree:
  block(last, draft, valid, lengths) -> Block    the verify forward's tokens, positions, mask
  accept(block, ...)                 -> Accepted `Verifier.verify` along a chain, or
                                                 `Verifier.verify_tree` walking a tree
  along / path_tokens / path_kv                  the accepted path's features, tokens, K/V
The verify block's node 0 is `last` (the root) and drafted node t is node t + 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jspec.drafters.base import Proposal
from jspec.models.llama import Chain, Tree
from jspec.sampling import Sampling, dense_q, process_logits, processed_logprobs
from jspec.state import is_eos
from jspec.verify.base import Verifier


class Block(NamedTuple):
    """One verify block of width w: `last` and the first w drafted nodes."""

    tokens: jax.Array  # i32[B, w+1] `last`, then the drafted tokens (0 where none)
    draft: jax.Array  # i32[B, w] the drafted tokens (0 where none)
    valid: jax.Array  # bool[B, w] nodes put up for verification
    positions: jax.Array  # i32[B, w+1] cache positions of the block's tokens
    mask: Chain | Tree  # the attention among the block's tokens
    parents: jax.Array | None  # i32[B, w+1] a tree's parent node (-1: the root); None: chain
    depth: jax.Array | None  # i32[B, w+1] a tree's node depth (0: the root); None: chain


class Accepted(NamedTuple):
    """What a verify accepted, per row (one named result for chains and trees)."""

    n: jax.Array  # i32[B] drafted tokens accepted
    next_token: jax.Array  # i32[B] the token after them (the target's correction or bonus)
    verifier: Any  # the verifier's state after this verify
    path: jax.Array | None  # i32[B, k+1] a tree's accepted nodes (0: the root); None: chain
    oracle: jax.Array  # i32[B] what would have been accepted had every verified slot been
    #   proposed (chains under an `oracle_pass` policy, greedy; else n)
    scored: jax.Array  # i32[B] nodes the row proposed and the policy put up for verification
    logprobs: jax.Array  # f32[B, m] log p of the emitted tokens, 0-padded to the round's most


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Topology:
    """How a round's N drafted nodes hang off `last`: a chain (`parents` None) or a tree."""

    parents: jax.Array | None  # i32[B, N] parent node (-1: `last`); None: a chain
    depth: jax.Array | None  # i32[B, N] tokens from `last` to the node; None: a chain
    k: int = dataclasses.field(metadata=dict(static=True))  # the longest path a round accepts

    @classmethod
    def of(cls, prop: Proposal, k: int) -> Topology:
        """The topology of a proposal whose longest accepted path is k tokens."""
        if prop.is_chain:
            return cls(parents=None, depth=None, k=k)
        return cls(parents=prop.parents, depth=prop.depth(), k=k)

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    def emit_width(self, nodes: int) -> int:
        """The most tokens a round emits (accepted + the next token) for N = `nodes`."""
        return (nodes if self.is_chain else self.k) + 1

    def verifiable(self, valid: jax.Array, tokens: jax.Array, stop: jax.Array,
                   room: jax.Array) -> jax.Array:
        """bool[B, N]: the proposed nodes (`valid`) worth verifying. A chain's slots no commit
        can keep (past the first drafted stop token, or past `room` i32[B] new tokens) are
        not verified: the committed tokens are the same, and verifiers with running
        measurements (DIVERSED, ASD) only see tokens that land in the output."""
        if not self.is_chain:
            return valid
        j = jnp.arange(valid.shape[1], dtype=jnp.int32)[None]
        first_eos = jnp.min(jnp.where(is_eos(tokens, stop) & valid, j, valid.shape[1]), axis=1)
        return valid & (j <= first_eos[:, None]) & (j < room[:, None])

    def block(self, last: jax.Array, draft: jax.Array, valid: jax.Array,
              lengths: jax.Array) -> Block:
        """The verify block of the first w nodes (draft i32[B, w], valid bool[B, w]) after
        `last` i32[B], its first token at cache position `lengths` i32[B]."""
        b, w = draft.shape
        toks = jnp.concatenate([last[:, None], draft], axis=1)  # [B, w+1]
        if self.is_chain:
            pos = lengths[:, None] + jnp.arange(w + 1, dtype=jnp.int32)[None]
            return Block(toks, draft, valid, pos, Chain(), None, None)
        par = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), self.parents[:, :w] + 1], axis=1)
        dep = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), self.depth[:, :w]], axis=1)
        return Block(toks, draft, valid, lengths[:, None] + dep, Tree(par), par, dep)

    def accept(self, block: Block, verifier: Verifier, vstate: Any, key: jax.Array,
               prop: Proposal, d: jax.Array, logits: jax.Array, final_hidden: jax.Array,
               sampling: Sampling, *, oracle_pass: bool, m_emit: int) -> Accepted:
        """Verify the block against the target's logits f32[B, w+1, V] (final hidden states
        f32[B, w+1, H] for a verifier that `needs_hidden`); `d` i32[B]: the nodes each row's
        length policy chose (a chain's later slots are not chosen)."""
        dw, vw = block.draft, block.valid
        b, w = dw.shape
        if self.is_chain:
            qw = None if prop.q is None else prop.q[:, :w]
            chosen = vw & (jnp.arange(w)[None, :] < d[:, None])
            kw = {}
            if verifier.supports.compact_q:  # q stays in the drafter's vocabulary
                kw["q_vocab"] = prop.q_vocab
            elif qw is not None:
                qw = dense_q(qw, prop.q_vocab, logits.shape[-1])
            if verifier.supports.needs_hidden:  # DIVERSED context-level head
                kw["hidden"] = (prop.hidden[:, :w], final_hidden[:, :w])
            n, nxt, vstate = verifier.verify(vstate, key, dw, qw, logits, sampling, chosen, **kw)
            # The oracle length: what the verifier would have accepted had every verified slot
            # been proposed (greedy: a second, cheap argmax pass). When sampling it is
            # observed only up to the row's own d (n; censored at d).
            oracle = n
            if oracle_pass and sampling.greedy:
                oracle, _, _ = verifier.verify(vstate, key, dw, qw, logits, sampling, vw, **kw)
            scored = jnp.sum(prop.valid[:, :w] & (jnp.arange(w)[None, :] < d[:, None]), axis=1,
                             dtype=jnp.int32)
            lp = emitted_logprobs(process_logits(logits, sampling), dw, n, nxt, m_emit)
            return Accepted(n, nxt, vstate, None, oracle, scored, lp)
        ok = jnp.concatenate([jnp.ones((b, 1), bool), vw], axis=1)
        kw = {}
        if prop.q is not None:  # children drawn from q: row t + 1 is node t's
            kw = dict(q=jnp.pad(prop.q[:, :w], ((0, 0), (1, 0), (0, 0))), q_vocab=prop.q_vocab,
                      max_children=prop.branching)
        n, path, nxt, vstate = verifier.verify_tree(vstate, key, block.tokens, block.parents,
                                                    block.depth, ok, logits, sampling, self.k,
                                                    **kw)
        scored = jnp.sum(prop.valid[:, :w], axis=1, dtype=jnp.int32)
        # The path's token at depth t + 1 was chosen from node path[:, t]'s logits.
        at = jnp.clip(path, 0, w)
        lp = emitted_logprobs(
            jnp.take_along_axis(process_logits(logits, sampling), at[:, :, None], axis=1),
            jnp.take_along_axis(dw, jnp.maximum(at[:, 1:] - 1, 0), axis=1), n, nxt, m_emit)
        return Accepted(n, nxt, vstate, path, n, scored, lp)

    def nothing_accepted(self, nxt: jax.Array, logprob: jax.Array, vstate: Any,
                         m_emit: int) -> Accepted:
        """The result of a round that verified nothing (no row proposed anything): the next
        token nxt i32[B] with its log p f32[B] from a one-token forward."""
        n = jnp.zeros_like(nxt)
        path = None if self.is_chain else jnp.zeros((nxt.shape[0], self.k + 1), jnp.int32)
        lp = jnp.pad(logprob[:, None], ((0, 0), (0, m_emit - 1)))
        return Accepted(n, nxt, vstate, path, n, n, lp)

    def along(self, f: jax.Array, path: jax.Array | None) -> jax.Array:
        """f32[B, T, ...] per block node -> [B, k+1, ...] along the accepted path (a chain's
        is its first k+1 nodes: padded; `path` None: the block's first nodes)."""
        if path is not None:
            return jnp.take_along_axis(f, path.reshape(*path.shape, *(1,) * (f.ndim - 2)), axis=1)
        return jnp.pad(f, ((0, 0), (0, self.k + 1 - f.shape[1])) + ((0, 0),) * (f.ndim - 2))

    def path_tokens(self, draft: jax.Array, path: jax.Array | None) -> jax.Array:
        """i32[B, N] drafted tokens -> the accepted path's drafted tokens in depth order
        (a chain: `draft` itself)."""
        if self.is_chain:
            return draft
        return jnp.take_along_axis(draft, jnp.maximum(path[:, 1:] - 1, 0), axis=1)

    def path_kv(self, new_kv: tuple[jax.Array, ...], path: jax.Array | None
                ) -> tuple[jax.Array, ...]:
        """The K/V to write at slots lengths + 0..: a chain's block as it is; a tree's accepted
        path in depth order (`path_kv`)."""
        return new_kv if self.is_chain else path_kv(new_kv, path)


def emitted_logprobs(z: jax.Array, toks: jax.Array, n: jax.Array, nxt: jax.Array,
                     m_emit: int) -> jax.Array:
    """f32[B, m_emit]: log p of the emitted tokens (toks i32[B, t] with nxt i32[B] at n i32[B],
    each chosen from processed logits z f32[B, t, V] at its own index), 0-padded past t. z is
    processed from the verify forward's whole logits, as the verifier processes them, so XLA
    computes that (top-p: a sort of the vocabulary) once."""
    rows = jnp.arange(toks.shape[0])
    toks = jnp.concatenate([toks, jnp.zeros_like(nxt)[:, None]], axis=1)[:, :z.shape[1]]
    lp = processed_logprobs(z, toks.at[rows, n].set(nxt))
    return jnp.pad(lp, ((0, 0), (0, m_emit - lp.shape[1])))


def path_kv(new_kv: tuple[jax.Array, ...], path: jax.Array) -> tuple[jax.Array, ...]:
    """The K/V of a tree's accepted path, in depth order: new_kv's arrays dtype[L, B, T, KV,
    hd] (node t at index t) -> dtype[L, B, D+1, KV, hd], index d the node path[:, d] (i32[B,
    D+1]). Written at slots lengths + 0..D, they commit the path (slots past the accepted
    length are scratch, as after a chain's verify)."""
    rows = jnp.arange(path.shape[0])[:, None]
    return tuple(a[:, rows, path] for a in new_kv)
