"""Reading a community checkpoint's config.json field by field (`jspec.drafters.interop`):
every field jspec reads is declared, an unknown one is refused by name, and a value jspec
cannot honour (sliding windows, unknown RoPE scaling) is a `JspecError`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jspec.errors import JspecError
from jspec.models.config import ModelConfig

EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
DFLASH_ARCHS = ("DFlashDraftModel",)
# Drafter architectures recognised only to be refused with a reason.
REFUSED_ARCHS = {
    "DFlash2DraftModel": "DFlash2 (grouped convolutions + a candidate selector) is not supported",
    "Eagle3Speculator": "the vLLM `speculators` layout is not supported: use the "
                        "SpecForge / vLLM `LlamaForCausalLMEagle3` layout",
    "EagleLlamaForCausalLM": "EAGLE-1/2 drafters are not supported (EAGLE-3 only)",
}


def checkpoint_kind(path: str | Path) -> str | None:
    """"eagle3" / "dflash" for a community drafter directory, None for anything else (an HF
    model directory, used as a draft model). Refused drafter layouts raise a JspecError."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise JspecError(f"cannot read {cfg_path}: {e}") from e
    return _architecture(cfg, str(cfg_path)) if isinstance(cfg, dict) else None


class _Fields:
    """A config dict read field by field; what was never read is an unknown field."""

    def __init__(self, d: dict[str, Any], where: str, ignored: frozenset[str] = frozenset()):
        if not isinstance(d, dict):
            raise JspecError(f"{where} must be a JSON object")
        self.d, self.where, self.used, self.ignored = d, where, set(), ignored

    def has(self, key: str) -> bool:
        self.used.add(key)
        return self.d.get(key) is not None

    def get(self, key: str, typ: type, default: Any = None, required: bool = False) -> Any:
        self.used.add(key)
        v = self.d.get(key)
        if v is None:
            if required:
                raise JspecError(f"{self.where}: missing required field {key!r}")
            return default
        try:
            if typ is int:
                if isinstance(v, bool) or float(v) != int(v):
                    raise ValueError(v)
                return int(v)
            if typ is bool:
                if not isinstance(v, bool):
                    raise ValueError(v)
                return v
            if typ in (list, dict):
                if not isinstance(v, typ):
                    raise ValueError(v)
                return v
            return typ(v)
        except (TypeError, ValueError) as e:
            raise JspecError(f"{self.where}: field {key!r} = {v!r} is not a valid "
                             f"{typ.__name__}") from e

    def expect(self, key: str, allowed: tuple[Any, ...], why: str = "") -> None:
        """The field is absent, null or one of `allowed` (anything else changes the model)."""
        self.used.add(key)
        v = self.d.get(key)
        if v is not None and v not in allowed:
            raise JspecError(f"{self.where}: unsupported {key} = {v!r} (jspec reads "
                             f"{' or '.join(map(repr, allowed))}{'; ' + why if why else ''})")

    def finish(self) -> None:
        unknown = sorted(set(self.d) - self.used - self.ignored)
        if unknown:
            raise JspecError(f"{self.where}: unknown field(s) {unknown}; jspec does not know "
                             "what they change, so it refuses rather than guess")


def _rope(f: _Fields, head_dim: int) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, rope_scaling pairs) from `rope_theta` / `rope_scaling` or transformers-5
    `rope_parameters`; LlamaConfig's default theta 10000 when none is given."""
    theta = f.get("rope_theta", float)
    scaling = f.get("rope_scaling", dict)
    rp = f.get("rope_parameters", dict)
    if rp is not None:
        theta = float(rp.get("rope_theta", theta if theta is not None else 10000.0))
        if rp.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    pairs = (None if scaling is None else
             tuple(sorted((k, v) for k, v in scaling.items() if isinstance(v, (int, float, str)))))
    theta = 10000.0 if theta is None else theta
    try:
        ModelConfig(head_dim=head_dim, rope_theta=theta, rope_scaling=pairs)
    except JspecError as e:
        raise JspecError(f"{f.where}: field 'rope_scaling': {e}") from e
    return theta, pairs


def _no_sliding_window(f: _Fields) -> None:
    types = f.get("layer_types", list)
    if types is not None and any(t != "full_attention" for t in types):
        raise JspecError(f"{f.where}: unsupported layer_types {types} (jspec's drafters use "
                         "full attention only)")
    if f.get("use_sliding_window", bool, False) and f.has("sliding_window"):
        raise JspecError(f"{f.where}: unsupported use_sliding_window = true")
    f.used.add("sliding_window")


def _architecture(cfg: dict[str, Any], where: str) -> str | None:
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        raise JspecError(f"{where}: field 'architectures' must be a list")
    for a in archs:
        if a in REFUSED_ARCHS:
            raise JspecError(f"{where}: {a}: {REFUSED_ARCHS[a]}")
        if a in EAGLE3_ARCHS:
            return "eagle3"
        if a in DFLASH_ARCHS:
            return "dflash"
    return None


