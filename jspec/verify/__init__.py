"""Verifiers: pure functions of (draft tokens, draft probs, target logits, key, state).

A verifier is a frozen, hashable config object with
  check(sampling)                      -> raises JspecError for an unsupported sampling mode
  init_state(batch, max_rounds)        -> its state pytree (lives in SpecState.verifier)
  verify(state, key, draft, q, logits, sampling, valid) -> (n_accepted, next_token, state)
and is a pytree (Lossless and ASD are static ones; DIVERSED's learned head has array leaves).
A verifier with `needs_hidden` also receives `hidden=(drafter hidden, target hidden)`.
"""

from jspec.verify.asd import ASD, ASDState
from jspec.verify.diversed import Diversed, DiversedHead, DiversedState
from jspec.verify.lossless import Lossless, leading_true, verify_chain

__all__ = ["ASD", "ASDState", "Diversed", "DiversedHead", "DiversedState", "Lossless",
           "leading_true", "parse_verifier", "verify_chain"]

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
