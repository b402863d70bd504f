"""Verifiers: pure functions of (draft tokens, draft probs, target logits, key, state).

A verifier is a frozen, hashable config object with
  check(sampling)                      -> raises JspecError for an unsupported sampling mode
  init_state(batch, max_rounds)        -> its state pytree (lives in SpecState.verifier)
  verify(state, key, draft, q, logits, sampling, valid) -> (n_accepted, next_token, state)
"""

from jspec.verify.asd import ASD, ASDState
from jspec.verify.lossless import (
    ACCEPTANCE_IMPLS,
    Lossless,
    fused_acceptance_supports,
    leading_true,
    verify_chain,
    verify_chain_fused,
)

__all__ = ["ACCEPTANCE_IMPLS", "ASD", "ASDState", "Lossless", "fused_acceptance_supports", "leading_true",
           "parse_verifier", "verify_chain", "verify_chain_fused", "with_acceptance_impl"]


def parse_verifier(spec: str) -> Lossless | ASD:
    """`lossless` | `asd[:budget=B,gate=G,cap=M]` (the CLI's --verifier)."""
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
    raise JspecError(f"unknown verifier {spec!r} (lossless, asd[:budget=B,gate=G,cap=M])")


def with_acceptance_impl(verifier: Lossless | ASD, impl: str) -> Lossless | ASD:
    """The verifier with acceptance `impl` ("xla" | "pallas"; the CLI's --acceptance-impl).

    Only `Lossless` has a kernel path: "pallas" with ASD is an error.
    """
    from jspec.errors import JspecError  # noqa: PLC0415

    if impl not in ACCEPTANCE_IMPLS:
        raise JspecError(f"acceptance impl must be one of {ACCEPTANCE_IMPLS}, got {impl!r}")
    if isinstance(verifier, Lossless):
        return Lossless(acceptance_impl=impl)
    if impl != "xla":
        raise JspecError(f"--acceptance-impl {impl} applies to the lossless verifier only")
    return verifier
