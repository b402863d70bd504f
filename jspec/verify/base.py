"""The verifier protocol: what every verifier declares and implements.

A verifier is a frozen, hashable configuration object that is also a pytree (Lossless and ASD
are static ones; DIVERSED's learned head has array leaves). It declares what it can verify in
`supports` (read once, in `generate`, before anything compiles — decode never asks a verifier's
type), and implements
  check(sampling)                         -> raises JspecError for an unsupported sampling mode
  check_pair(target_config, drafter)      -> raises JspecError when it cannot serve this pair
  init_state(batch, max_rounds)           -> its state pytree (lives in SpecState.verifier)
  verify(state, key, draft, q, logits, sampling, valid[, hidden=]) -> (n, next_token, state)
  plain_step(state)                       -> the state after a round that drafted nothing
  verify_tree(state, key, tokens, parents, depth, valid, logits, sampling, max_depth[, q=,
              q_vocab=, max_children=])  -> (n, path, next_token, state)  (`supports.trees`)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jspec.errors import JspecError
from jspec.sampling import Sampling


@dataclasses.dataclass(frozen=True)
class Supports:
    """What a verifier can verify.

    greedy / sampled: temperature 0 / > 0.
    exact: every committed token is distributed exactly as the target's (greedy: identical).
      LibraSpec's per-row lengths and the tree walk rest on it.
    trees: it verifies token trees (`verify_tree`; Lossless: the tree walk, exact).
    needs_hidden: `verify` also takes `hidden=(drafter hidden, target hidden)` at the drafted
      positions (DIVERSED's context-level head).
    compact_q: `verify` takes q over the drafter's vocabulary, f32[B, K, Vq], with
      `q_vocab=` i32[Vq] | None (its target ids; None: all V); otherwise the round hands it q
      scattered to the target vocabulary, f32[B, K, V] (`jspec.sampling.dense_q`).
    """

    greedy: bool = True
    sampled: bool = True
    exact: bool = True
    trees: bool = False
    needs_hidden: bool = False
    compact_q: bool = False


class Verifier:
    """Defaults of the protocol; a verifier overrides what differs."""

    name = "verifier"

    @property
    def supports(self) -> Supports:
        return Supports()

    def check(self, sampling: Sampling) -> None:
        s = self.supports
        if sampling.greedy and not s.greedy:
            raise JspecError(f"{self.name} does not verify greedy decoding (temperature 0)")
        if not sampling.greedy and not s.sampled:
            raise JspecError(f"{self.name} verifies greedy decoding only: use temperature 0 "
                             f"(got temperature {sampling.temperature})")

    def check_pair(self, target_config: Any, drafter: Any) -> None:
        """Nothing to check by default."""

    def init_state(self, batch: int, max_rounds: int) -> Any:
        return None

    def plain_step(self, state: Any) -> Any:
        return state

    def verify(self, vstate: Any, key: jax.Array, draft: jax.Array, q: jax.Array | None,
               target_logits: jax.Array, sampling: Sampling, valid: jax.Array, **kw: Any
               ) -> tuple[jax.Array, jax.Array, Any]:
        raise NotImplementedError

    def verify_tree(self, vstate: Any, key: jax.Array, tokens: jax.Array, parents: jax.Array,
                    depth: jax.Array, valid: jax.Array, target_logits: jax.Array,
                    sampling: Sampling, max_depth: int, q: jax.Array | None = None,
                    q_vocab: jax.Array | None = None, max_children: int = 0
                    ) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
        """Verify a token tree (root = `last` at node 0; shapes as `jspec.verify.tree.walk`):
        (n accepted, path i32[B, max_depth + 1], next token, state). `q` f32[B, T, Vq] over
        `q_vocab`: per node the distribution its token was drawn from (None: deterministic
        nodes); `max_children`: static bound on a node's children (0: unknown)."""
        raise NotImplementedError(f"{self.name} does not verify trees")


def check_verifier(verifier: Any, sampling: Sampling, *, target_config: Any, drafter: Any,
                   dynamic_length: bool, tree: bool) -> None:
    """Everything `generate` checks about a verifier, once, at the edge.

    Args:
      dynamic_length: the length policy chooses lengths per row (LibraSpec): needs `exact`.
      tree: the drafter proposes trees: needs `trees`.
    """
    if not isinstance(verifier, Verifier):
        raise JspecError(f"unsupported verifier {type(verifier).__name__} "
                         "(jspec.Lossless, jspec.ASD or jspec.Diversed, or a jspec.verify.Verifier)")
    s = verifier.supports
    if dynamic_length and not s.exact:
        raise JspecError("LibraSpec verifies losslessly: use verifier=jspec.Lossless() "
                         f"(got {type(verifier).__name__})")
    if tree and not s.trees:
        raise JspecError(f"tree drafters (D2SD, top-k trees) verify by walking the tree, which is "
                         f"lossless: use jspec.Lossless(), got {type(verifier).__name__}")
    verifier.check(sampling)
    verifier.check_pair(target_config, drafter)
