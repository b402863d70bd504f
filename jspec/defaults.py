"""The measured-best decoding configuration per drafter: what jspec uses when not told.

`generate --drafter NAME` with no `--k`/`--length`/`--dtype`, and `jspec.generate(...,
drafter=d)` with no `length=` (d from `load_drafter(NAME)`), use the record of NAME:
  1. the user's record, written by `python -m jspec calibrate --drafter NAME --save` on their
     machine: `$JSPEC_DEFAULTS`, else `~/.config/jspec/defaults.json`;
  2. the shipped record, `jspec/assets/defaults.json`, measured on the 2-core CPU these
     drafters were trained on (docs/BENCHMARKS.md names the run);
  3. none: k = 5 (`FixedLength()`), and the CLI's float32.
A record is keyed by the drafter spec's base name ("ngram" for "ngram:n=4", "smollm2-135m-eagle3"
for "smollm2-135m-eagle3:cut=0.5"; a "+proposer" keeps its suffix: "smollm2-135m-eagle3+topk").
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from jspec.errors import JspecError

SHIPPED = Path(__file__).parent / "assets" / "defaults.json"
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Record:
    """k: drafted tokens per round; dtype: the target's dtype; max_batch: the largest batch at
    which speculation beat plain decoding (0: no limit; past it `generate` with no `length=`
    decodes plainly); source: where it was measured."""

    k: int = 5
    dtype: str = "float32"
    source: str = ""
    max_batch: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or not 1 <= self.k <= 64:
            raise JspecError(f"defaults record: k must be an integer in [1, 64], got {self.k!r}")
        if self.dtype not in DTYPES:
            raise JspecError(f"defaults record: dtype must be one of {DTYPES}, got "
                             f"{self.dtype!r}")
        if not isinstance(self.max_batch, int) or self.max_batch < 0:
            raise JspecError(f"defaults record: max_batch must be an integer >= 0 (0: no limit), "
                             f"got {self.max_batch!r}")


def user_path() -> Path:
    env = os.environ.get("JSPEC_DEFAULTS")
    return Path(env) if env else Path.home() / ".config" / "jspec" / "defaults.json"


def base_name(spec: str) -> str:
    """The record key of a drafter spec: options after ':' dropped, a '+proposer' kept."""
    inner, plus, wrapper = spec.partition("+")
    key = inner.split(":", 1)[0]
    return key + plus + wrapper.split(":", 1)[0] if plus else key


def read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise JspecError(f"cannot read the defaults file {path}: {e}") from e
    if not isinstance(data, dict):
        raise JspecError(f"{path}: a defaults file is a JSON object of records")
    return data


def _record(raw: Any, path: Path, key: str) -> Record:
    if not isinstance(raw, dict) or set(raw) - {"k", "dtype", "source", "max_batch"}:
        raise JspecError(f"{path}: record {key!r} must be an object with k, dtype, source "
                         f"(and max_batch)")
    return Record(**raw)


def lookup(spec: str) -> Record | None:
    """The record for a drafter spec: the user's, else the shipped one, else None."""
    key = base_name(spec)
    for path in (user_path(), SHIPPED):
        data = read(path)
        if key in data:
            return _record(data[key], path, key)
    return None


def save(spec: str, record: Record, path: Path | None = None) -> Path:
    """Write `record` for `spec` into the user's defaults file (other records kept)."""
    path = user_path() if path is None else path
    data = read(path)
    data[base_name(spec)] = dataclasses.asdict(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return path
