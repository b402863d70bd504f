"""Verifiers: pure functions of (draft tokens, draft probs, target logits, key, state)."""

from jspec.verify.lossless import Lossless, leading_true, verify_chain

__all__ = ["Lossless", "leading_true", "verify_chain"]
