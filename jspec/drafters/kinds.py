"""The trained-drafter kinds, one registry entry each: what a `kind` in a drafter file or
config means everywhere (loading, checkpoint interop, `python -m train`).

An entry names the drafter class and its constructor, its parameter dataclass and their
initialiser, the community checkpoint format it reads and writes (`jspec.drafters.interop`:
the format's reader and writer are looked up by that name), and the kinds a training run of it
may start from. Code asks the entry (`get(kind)`), never compares kind strings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jspec.drafters import d2sd, dflash, eagle3
from jspec.drafters.params import PARAMS
from jspec.errors import JspecError


@dataclasses.dataclass(frozen=True)
class Kind:
    """One trained-drafter kind.

    name: the `DrafterConfig.kind` string in files.
    drafter: the class its constructor returns.
    params: the parameter dataclass (`jspec.drafters.params`).
    init_params: (cfg, key) -> fresh parameters (None: only fine-tuned from another kind).
    make: (cfg, params, vocab_ids, target_weights, *, cut, name) -> drafter (None: built
      around a first drafter, `first_drafter`).
    checkpoint: the community checkpoint format it imports and exports (None: none).
    starts_from: kinds whose files a training run of this kind starts from (() : from scratch).
    first_drafter: the drafter is built on a first drafter its file names (D²SD); it takes the
      tree options (`branches=`, `branch_len=`) and no `cut=`.
    """

    name: str
    drafter: type
    params: type
    init_params: Callable[..., Any] | None
    make: Callable[..., Any] | None
    checkpoint: str | None = None
    starts_from: tuple[str, ...] = ()
    first_drafter: bool = False


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("eagle3", eagle3.Eagle3, PARAMS["eagle3"], eagle3.init_params, eagle3.make,
         checkpoint="eagle3"),
    Kind("dflash", dflash.DFlash, PARAMS["dflash"], dflash.init_params, dflash.make,
         checkpoint="dflash"),
    Kind("d2sd", d2sd.D2SD, PARAMS["d2sd"], None, None, starts_from=("dflash", "d2sd"),
         first_drafter=True),
)}


def get(kind: str) -> Kind:
    """The entry of `kind`; a JspecError naming the known kinds for any other."""
    entry = KINDS.get(kind)
    if entry is None:
        raise JspecError(f"unknown trained drafter kind {kind!r}; known: {sorted(KINDS)}")
    return entry


def by_checkpoint(fmt: str) -> Kind:
    """The kind that reads and writes community checkpoints of format `fmt`."""
    for entry in KINDS.values():
        if entry.checkpoint == fmt:
            return entry
    raise JspecError(f"no drafter kind reads {fmt!r} checkpoints")
