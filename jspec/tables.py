"""Plain-text tables for the benchmark reports."""

from __future__ import annotations

from typing import Any


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    print(f"\n{title}")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=False)))
    for r in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=False)))
