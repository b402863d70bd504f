"""Verifiers: pure functions of (draft tokens, draft probs, target logits, key, state).

A verifier is a frozen, hashable config object with
  check(sampling)                      -> raises JspecError for an unsupported sampling mode
  init_state(batch, max_rounds)        -> its state pytree (lives in SpecState.verifier)
  verify(state, key, draft, q, logits, sampling, valid) -> (n_accepted, next_token, state)
"""

from jspec.verify.asd import ASD, ASDState
from jspec.verify.lossless import Lossless, leading_true, verify_chain

__all__ = ["ASD", "ASDState", "Lossless", "leading_true", "verify_chain"]
