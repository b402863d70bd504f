"""Verifiers: pure functions of (draft tokens, draft probs, target logits, key, state).

Every verifier subclasses `jspec.verify.base.Verifier`: it declares what it can verify in
`supports` (`Supports`: greedy, sampled, exact, trees, needs_hidden) and implements `check`,
`check_pair`, `init_state`, `verify` and `plain_step` (the protocol is in `base.py`);
`generate` checks a verifier once, with `check_verifier`, and never asks its type.
"""

import dataclasses

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

USAGE = "lossless, asd[:budget=B,gate=G,cap=M], diversed[:w=W | :head=PATH]"


def parse_verifier(spec: str) -> Lossless | ASD | Diversed:
    """`lossless` | `asd[:budget=B,gate=G,cap=M]` | `diversed[:w=W | :head=PATH]` (--verifier)."""
    from jspec.errors import JspecError  # noqa: PLC0415

    kind, _, args = spec.partition(":")
    if kind == "lossless" and not args:
        return Lossless()
    if kind == "asd":
        kw: dict[str, float | int] = {}
        for part in filter(None, args.split(",")):
            key, sep, val = part.partition("=")
            if not sep or key not in ("budget", "gate", "cap"):
                raise JspecError(f"bad ASD option {part!r}: expected budget=, gate= or cap=")
            try:
                kw[key] = int(val) if key == "cap" else float(val)
            except ValueError as e:
                raise JspecError(f"bad ASD option {part!r}: not a number") from e
        return ASD(**kw)
    if kind == "diversed":
        key, sep, val = args.partition("=")
        if not args:
            return Diversed()
        if key == "w" and sep:
            try:
                w = float(val)
            except ValueError as e:
                raise JspecError(f"bad DIVERSED weight {val!r}: not a number") from e
            return Diversed(weight=w)
        if key == "head" and sep and val:
            return Diversed(head=DiversedHead.load(val))
        raise JspecError(f"bad DIVERSED option {args!r}: expected w=W or head=PATH")
    raise JspecError(f"unknown verifier {spec!r} ({USAGE})")


def with_acceptance_impl(verifier: Lossless | ASD | Diversed, impl: str
                         ) -> Lossless | ASD | Diversed:
    """The verifier with acceptance `impl` ("xla" | "pallas"; the CLI's --acceptance-impl).

    `Lossless` and `Diversed` (sampled, one w per row) have a kernel path; "pallas" with ASD
    is an error.
    """
    from jspec.errors import JspecError  # noqa: PLC0415

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
