"""Verifiers: pure functions of (draft tokens, draft probs, target logits, key, state).

Every verifier subclasses `jspec.verify.base.Verifier`: it declares what it can verify in
`supports` (`Supports`: greedy, sampled, exact, trees, needs_hidden) and implements `check`,
`check_pair`, `init_state`, `verify` and `plain_step` (the protocol is in `base.py`);
`generate` checks a verifier once, with `check_verifier`, and never asks its type.
"""

import dataclasses

from jspec.errors import JspecError
from jspec.specs import Registry
from jspec.verify.asd import ASD, ASDState
from jspec.verify.base import Supports, Verifier, check_verifier
from jspec.verify.diversed import Diversed, DiversedHead, DiversedState
from jspec.verify.lossless import (
    ACCEPTANCE_IMPLS,
    Lossless,
    fused_acceptance_supports,
    leading_true,
    verify_chain,
    verify_chain_fused,
)

__all__ = ["ACCEPTANCE_IMPLS", "ASD", "ASDState", "Diversed", "DiversedHead", "DiversedState",
           "Lossless", "Supports", "Verifier", "check_verifier", "fused_acceptance_supports",
           "leading_true", "parse_verifier", "verify_chain", "verify_chain_fused",
           "with_acceptance_impl"]

def _diversed(w: float | None = None, head: str | None = None) -> Diversed:
    if w is not None and head is not None:
        raise JspecError("bad DIVERSED options: expected w=W or head=PATH, not both")
    if head is not None:
        return Diversed(head=DiversedHead.load(head))
    return Diversed() if w is None else Diversed(weight=w)


VERIFIERS = Registry("verifier")
VERIFIERS.register("lossless", Lossless)
VERIFIERS.register("asd", ASD, {"budget": float, "gate": float, "cap": int},
                   usage="budget=B,gate=G,cap=M")
VERIFIERS.register("diversed", _diversed, {"w": float, "head": str}, usage="w=W or head=PATH")
USAGE = VERIFIERS.usage()


def parse_verifier(spec: str) -> Lossless | ASD | Diversed:
    """`lossless` | `asd[:budget=B,gate=G,cap=M]` | `diversed[:w=W | :head=PATH]` (--verifier)."""
    return VERIFIERS.parse(spec)


def with_acceptance_impl(verifier: Lossless | ASD | Diversed, impl: str
                         ) -> Lossless | ASD | Diversed:
    """The verifier with acceptance `impl` ("xla" | "pallas"; the CLI's --acceptance-impl).

    `Lossless` and `Diversed` (sampled, one w per row) have a kernel path; "pallas" with ASD
    is an error.
    """
    if impl not in ACCEPTANCE_IMPLS:
        raise JspecError(f"acceptance impl must be one of {ACCEPTANCE_IMPLS}, got {impl!r}")
    if isinstance(verifier, Lossless):
        return Lossless(acceptance_impl=impl)
    if isinstance(verifier, Diversed):
        return dataclasses.replace(verifier, acceptance_impl=impl)
    if impl != "xla":
        raise JspecError(f"--acceptance-impl {impl} applies to the lossless and DIVERSED "
                         "verifiers only")
    return verifier
