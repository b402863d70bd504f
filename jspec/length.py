"""How many drafted tokens a round verifies."""

from __future__ import annotations

import dataclasses

from jspec.errors import JspecError


@dataclasses.dataclass(frozen=True)
class FixedLength:
    """Verify exactly `k` drafted tokens every round (static: changing k recompiles)."""

    k: int = 5

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or not 1 <= self.k <= 64:
            raise JspecError(f"speculation length k must be an integer in [1, 64], got {self.k!r}")

    @property
    def max_k(self) -> int:
        return self.k


def parse_length(spec: str) -> FixedLength:
    """`fixed:K` (the CLI's --length); `--k K` is the short form."""
    kind, _, arg = spec.partition(":")
    if kind == "fixed":
        try:
            return FixedLength(int(arg))
        except ValueError as e:
            raise JspecError(f"bad length spec {spec!r}: expected fixed:K") from e
    raise JspecError(f"unknown length policy {spec!r} (available: fixed:K)")
