"""The measured-best decoding configuration per drafter and machine class: what jspec uses when
not told.

`generate --drafter NAME` with no `--k`/`--length`/`--dtype`, and `jspec.generate(...,
drafter=d)` with no `length=` (d from `load_drafter(NAME, best=True)`), use the record of NAME for this
machine's class (`jspec.provenance.machine_class()`: "cpu-bf16" for a CPU with bfloat16 matmul
instructions, "cpu" for one without, "gpu", "tpu"; `$JSPEC_MACHINE_CLASS` overrides it):
  1. the user's record, written by `python -m jspec calibrate --drafter NAME --save` on their
     machine: `$JSPEC_DEFAULTS`, else `~/.config/jspec/defaults.json`;
  2. the shipped record, `jspec/assets/defaults.json`, measured on 2-core CPUs of each class
     (docs/BENCHMARKS.md names the runs);
  3. none: k = 5 (`FixedLength()`), and the dtype of plain decoding (below).
Plain decoding has a record too, keyed "plain" (`PLAIN`; dtype only): `plain_dtype()` is the
dtype `generate` with no `--drafter` (or a drafter with no record) decodes in, so plain and
speculative decoding agree on dtype unless told otherwise: bfloat16 on `cpu-bf16`, float32 on
`cpu`, float32 on a class with no record.
A record may also name a proposer to wrap around the drafter (`"proposer": "ngram"`: the
measured-best configuration is `NAME+ngram`); `resolve(NAME)` gives that spec, which
`generate --drafter NAME` (lossless, chain lengths) and `load_drafter(NAME, best=True)` load.
A defaults file maps machine classes to records, each keyed by the drafter spec's base name
("ngram" for "ngram:n=4", "smollm2-135m-eagle3" for "smollm2-135m-eagle3:cut=0.5"; a
"+proposer" keeps its suffix: "smollm2-135m-eagle3+topk"):
  {"cpu": {"ngram": {"k": 2, "dtype": "float32", "source": "..."}}, "cpu-bf16": {...}}
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from jspec.errors import JspecError
from jspec.provenance import MACHINE_CLASSES, machine_class

SHIPPED = Path(__file__).parent / "assets" / "defaults.json"
DTYPES = ("float32", "bfloat16")
PLAIN = "plain"  # the record key of plain (autoregressive) decoding: its dtype


@dataclasses.dataclass(frozen=True)
class Record:
    """k: drafted tokens per round; dtype: the target's dtype; max_batch: the largest batch at
    which speculation beat plain decoding (None: no limit; 0: not even batch 1; past it
    `generate` with no `length=` decodes plainly); proposer: the proposer wrapped around the
    drafter in the measured-best configuration ("" none); source: where it was measured."""

    k: int = 5
    dtype: str = "float32"
    source: str = ""
    max_batch: int | None = None
    proposer: str = ""  # "" none; else a proposer spec ("ngram", "ngram:n_min=3") around it

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or not 1 <= self.k <= 64:
            raise JspecError(f"defaults record: k must be an integer in [1, 64], got {self.k!r}")
        if self.dtype not in DTYPES:
            raise JspecError(f"defaults record: dtype must be one of {DTYPES}, got "
                             f"{self.dtype!r}")
        if self.max_batch is not None and (not isinstance(self.max_batch, int)
                                           or self.max_batch < 0):
            raise JspecError(f"defaults record: max_batch must be null (no limit) or an integer "
                             f">= 0 (0: plain decoding is faster at every batch), got "
                             f"{self.max_batch!r}")
        if not isinstance(self.proposer, str) or "+" in self.proposer:
            raise JspecError(f"defaults record: proposer must be one proposer spec such as "
                             f"'ngram' (or ''), got {self.proposer!r}")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The measured settings a drafter carries, from its record (`jspec.drafters.base.settings_of`
    reads them; `Capabilities` says what a drafter is, this what was measured for it).

    k: the chain length `generate` verifies per round when given no `length=`.
    max_batch: the largest batch at which speculation beat plain decoding (None: no limit; 0:
      not even batch 1); `generate` with no `length=` and lossless verification decodes a
      larger batch plainly (the same output distribution, greedy the same tokens).
    """

    k: int = 5
    max_batch: int | None = None


FIELDS = frozenset(f.name for f in dataclasses.fields(Record))


def user_path() -> Path:
    env = os.environ.get("JSPEC_DEFAULTS")
    return Path(env) if env else Path.home() / ".config" / "jspec" / "defaults.json"


def base_name(spec: str) -> str:
    """The record key of a drafter spec: options after ':' dropped, a '+proposer' kept."""
    inner, plus, wrapper = spec.partition("+")
    key = inner.split(":", 1)[0]
    return key + plus + wrapper.split(":", 1)[0] if plus else key


def read(path: Path) -> dict[str, dict[str, Any]]:
    """A defaults file as {machine class: {drafter key: raw record}} ({} when there is none)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise JspecError(f"cannot read the defaults file {path}: {e}") from e
    if not isinstance(data, dict):
        raise JspecError(f"{path}: a defaults file is a JSON object of machine classes")
    for cls, table in data.items():
        if cls not in MACHINE_CLASSES or not isinstance(table, dict):
            old = isinstance(table, dict) and "k" in table
            raise JspecError(
                f"{path}: a defaults file maps machine classes {MACHINE_CLASSES} to objects of "
                f"records, got key {cls!r}" + (
                    " (a record: the file was written by an older jspec, before records were "
                    "kept per machine class; delete it and rerun `python -m jspec calibrate "
                    "--save`)" if old else ""))
    return data


def _record(raw: Any, path: Path, key: str) -> Record:
    if not isinstance(raw, dict) or set(raw) - FIELDS:
        raise JspecError(f"{path}: record {key!r} must be an object with k, dtype, source "
                         f"(and max_batch, proposer)")
    return Record(**raw)


def lookup(spec: str, machine: str | None = None) -> Record | None:
    """The record for a drafter spec on a machine class (default: this machine's): the user's,
    else the shipped one, else None."""
    key, cls = base_name(spec), machine or machine_class()
    for path in (user_path(), SHIPPED):
        table = read(path).get(cls, {})
        if key in table:
            return _record(table[key], path, f"{cls}/{key}")
    return None


def plain_dtype(machine: str | None = None) -> str:
    """The dtype plain decoding measured fastest on a machine class (default: this machine's):
    the "plain" record's (the user's, else the shipped one), else float32."""
    record = lookup(PLAIN, machine)
    return record.dtype if record is not None else "float32"


def dtype_for(spec: str | None, machine: str | None = None) -> str:
    """The dtype `generate` decodes in when not told: the drafter's record's, else (no drafter,
    or one with no record) plain decoding's, so the two agree unless a record says otherwise."""
    record = lookup(spec, machine) if spec else None
    return record.dtype if record is not None else plain_dtype(machine)


def resolve(spec: str, machine: str | None = None) -> str:
    """The drafter spec of `spec`'s measured-best configuration: `spec + "+" + proposer` when
    its record names a proposer and `spec` names none, else `spec` unchanged.
    ("smollm2-135m-eagle3" -> "smollm2-135m-eagle3+ngram" on a `cpu` machine.)"""
    if "+" in spec:
        return spec
    record = lookup(spec, machine)
    return f"{spec}+{record.proposer}" if record is not None and record.proposer else spec


def save(spec: str, record: Record, path: Path | None = None,
         machine: str | None = None) -> Path:
    """Write `record` for `spec` on a machine class (default: this machine's) into the user's
    defaults file (other records kept)."""
    path = user_path() if path is None else path
    data = read(path)
    raw = {k: v for k, v in dataclasses.asdict(record).items() if k != "proposer" or v}
    data.setdefault(machine or machine_class(), {})[base_name(spec)] = raw
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return path
