"""One grammar for spec strings — `NAME[:key=value,key=value,...]` — and registries of named
things built from them: length policies (`--length`), verifiers (`--verifier`) and drafters
(`load_drafter`, `--drafter`). An entry names its options and their types; parsing refuses an
unknown name, an unknown option, a repeated option or a value of the wrong type, with the
entry's usage in the message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jspec.errors import JspecError


def ints(text: str) -> tuple[int, ...]:
    """An option type: integers separated by '/' (e.g. widths=1/2/4)."""
    return tuple(int(x) for x in text.split("/"))


TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", ints: "integers a/b/c"}


def split_spec(spec: str) -> tuple[str, list[tuple[str, str | None]]]:
    """`NAME:a=1,b,c=x` -> ("NAME", [("a", "1"), ("b", None), ("c", "x")]); option names with
    '-' are read as '_'."""
    name, _, arg = spec.strip().partition(":")
    parts = []
    for part in filter(None, (p.strip() for p in arg.split(","))):
        key, sep, val = part.partition("=")
        parts.append((key.strip().replace("-", "_"), val.strip() if sep else None))
    return name.strip(), parts


def split_list(text: str) -> list[str]:
    """A comma-separated list of specs whose own options hold commas:
    "e+topk:k=4,nodes=12@4,ngram@3" -> ["e+topk:k=4,nodes=12@4", "ngram@3"]. A piece that is
    only an option (`key=value`, no ':' before its '=') continues the spec before it."""
    out: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        key, eq, _ = piece.partition("=")
        if eq and ":" not in key and out and ":" in out[-1]:
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


@dataclasses.dataclass(frozen=True)
class Entry:
    """A named builder: `build(**context, **options)`.

    options: option name -> type (int, float, str, `ints`).
    positional: the option a bare value stands for (`fixed:4` is k=4), if any.
    usage: what the options look like, for messages and --help.
    """

    build: Callable[..., Any]
    options: dict[str, Callable[[str], Any]]
    positional: str | None = None
    usage: str = ""


class Registry:
    """Names -> entries for one kind of thing (`what`: "length policy", "verifier", ...)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.entries: dict[str, Entry] = {}

    def register(self, name: str, build: Callable[..., Any],
                 options: dict[str, Callable[[str], Any]] | None = None,
                 positional: str | None = None, usage: str = "") -> None:
        if name in self.entries:
            raise ValueError(f"{self.what} {name!r} registered twice")
        self.entries[name] = Entry(build, dict(options or {}), positional, usage)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def usage(self) -> str:
        """Every entry with its options, e.g. `fixed:K, libraspec[:n=N,...]`."""
        def one(n: str, e: Entry) -> str:
            if not e.usage:
                return n
            return f"{n}:{e.usage}" if e.positional else f"{n}[:{e.usage}]"
        return ", ".join(one(n, e) for n, e in self.entries.items())

    def options(self, name: str, parts: list[tuple[str, str | None]]) -> dict[str, Any]:
        """The typed options of entry `name` from `split_spec`'s parts."""
        entry = self.entries[name]
        want = entry.usage or "no options"
        out: dict[str, Any] = {}
        for i, (key, val) in enumerate(parts):
            if val is None and i == 0 and entry.positional is not None and len(parts) == 1:
                key, val = entry.positional, key
            if val is None or key not in entry.options:
                raise JspecError(f"bad {self.what} option {key!r} in {name!r}: expected {want}")
            if key in out:
                raise JspecError(f"{self.what} option {key!r} given twice in {name!r}")
            typ = entry.options[key]
            try:
                out[key] = typ(val)
            except ValueError as e:
                raise JspecError(f"bad {self.what} option {key}={val!r}: not "
                                 f"{TYPE_WORDS.get(typ, 'valid')} (expected {want})") from e
        return out

    def parse(self, spec: str, **context: Any) -> Any:
        """Build the thing `spec` names (`context`: extra keyword arguments for the builder)."""
        name, parts = split_spec(spec)
        if name not in self.entries:
            raise JspecError(f"unknown {self.what} {spec!r} (available: {self.usage()})")
        return self.entries[name].build(**context, **self.options(name, parts))
