"""The trained drafters' parameters as registered dataclasses (`Eagle3Params`, `DFlashParams`)
and their flat names in files (`to_flat` / `from_flat`: "fc", "wq", "l0.wq", ...).

Layers are the target's `LayerWeights`; every field declares its logical sharding axes. The
feature statistics (`FROZEN`) are set from data, not trained (`split_frozen`, `with_stats`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jspec.errors import JspecError
from jspec.models.blocks import LayerWeights
from jspec.sharding import logical

FROZEN = ("feat_mean", "feat_std")  # parameters set from data statistics, not trained


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Eagle3Params:
    """EAGLE-3: fc over the F fused features, input norms, one decoder layer, head norm, VAT
    head. Flat names: the fields, the layer's without a prefix ("wq")."""

    fc: jax.Array = logical(None, "embed")  # [F*D, D]
    norm_emb: jax.Array = logical(None)  # f32[D]
    norm_feat: jax.Array = logical(None)  # f32[D]
    final_norm: jax.Array = logical(None)  # f32[D]
    vh_w: jax.Array = logical(None)  # f32[D] verification head (VAT)
    vh_b: jax.Array = logical(None)  # f32[1]
    layer: LayerWeights = dataclasses.field(metadata={"flat": ""})  # q/k/v read 2D: [emb; g]
    feat_mean: jax.Array | None = logical(None, "embed", default=None)  # f32[F, D] (FROZEN)
    feat_std: jax.Array | None = logical(None, "embed", default=None)  # f32[F, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DFlashParams:
    """DFlash (and each D²SD drafter): fc + norm over the features, MASK / slot embeddings,
    decoder layers, head norm, VAT head. Flat names: the fields, layer i's as "l{i}.wq"."""

    fc: jax.Array = logical(None, "embed")  # [F*D, D]
    fc_norm: jax.Array = logical(None)  # f32[D]
    final_norm: jax.Array = logical(None)  # f32[D]
    vh_w: jax.Array = logical(None)  # f32[D]
    vh_b: jax.Array = logical(None)  # f32[1]
    layers: tuple[LayerWeights, ...] = dataclasses.field(metadata={"flat": "l{i}."})
    # jspec's block inputs (block_input="jspec"); None for the release's token inputs.
    mask_emb: jax.Array | None = logical(None, default=None)  # f32[D]
    slot_emb: jax.Array | None = logical(None, None, default=None)  # f32[γ, D]
    feat_mean: jax.Array | None = logical(None, "embed", default=None)  # f32[F, D] (FROZEN)
    feat_std: jax.Array | None = logical(None, "embed", default=None)  # f32[F, D]


Params = Eagle3Params | DFlashParams
PARAMS: dict[str, type] = {"eagle3": Eagle3Params, "dflash": DFlashParams, "d2sd": DFlashParams}
_LAYER_REQUIRED = ("wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def to_flat(p: Params) -> dict[str, jax.Array]:
    """The flat names of `p`'s arrays (files, interop): fields, layers by their prefix."""
    out: dict[str, jax.Array] = {}
    for f in dataclasses.fields(p):
        val = getattr(p, f.name)
        if "flat" in f.metadata:
            lws = val if isinstance(val, tuple) else (val,)
            for i, lw in enumerate(lws):
                pre = f.metadata["flat"].format(i=i)
                out.update({pre + g.name: getattr(lw, g.name) for g in dataclasses.fields(lw)
                            if getattr(lw, g.name) is not None})
        elif val is not None:
            out[f.name] = val
    return out


def from_flat(kind: str, flat: dict[str, Any]) -> Params:
    """`to_flat`'s inverse for a drafter of `kind`; clear errors for missing or unknown names."""
    cls = PARAMS.get(kind)
    if cls is None:
        raise JspecError(f"unknown trained drafter kind {kind!r}; known: {sorted(PARAMS)}")
    rest = dict(flat)

    def one_layer(pre: str) -> LayerWeights:
        miss = [n for n in _LAYER_REQUIRED if pre + n not in rest]
        if miss:
            raise JspecError(f"{kind} drafter parameters lack {[pre + n for n in miss]}")
        return LayerWeights(**{g.name: rest.pop(pre + g.name, None)
                               for g in dataclasses.fields(LayerWeights)})

    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if "flat" in f.metadata:
            pat = f.metadata["flat"]
            if "{i}" in pat:
                n = 0
                while pat.format(i=n) + "wq" in rest:
                    n += 1
                kw[f.name] = tuple(one_layer(pat.format(i=i)) for i in range(n))
            else:
                kw[f.name] = one_layer(pat)
        elif f.name in rest:
            kw[f.name] = rest.pop(f.name)
        elif f.default is dataclasses.MISSING:
            raise JspecError(f"{kind} drafter parameters lack {f.name!r}")
    if rest:
        raise JspecError(f"unknown {kind} drafter parameters: {sorted(rest)}")
    return cls(**kw)


def split_frozen(p: Params) -> tuple[Params, dict[str, jax.Array]]:
    """(the trained parameters: FROZEN fields None, the FROZEN feature statistics)."""
    return (dataclasses.replace(p, **dict.fromkeys(FROZEN)),
            {k: getattr(p, k) for k in FROZEN})


def with_stats(p: Params, stats: dict[str, jax.Array]) -> Params:
    """`p` with the FROZEN feature statistics set (`split_frozen`'s inverse)."""
    return dataclasses.replace(p, **stats)




# The drafter parameters `dense` multiplies by (fields of the params and of their layers).
MATRICES = frozenset({"fc", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"})


def cast_matrices(p: Any, dtype: Any) -> Any:
    """`p` (params or a layer) with its MATRICES fields in `dtype`, everything else as is."""
    kw = {}
    for f in dataclasses.fields(p):
        val = getattr(p, f.name)
        if f.name in MATRICES and val is not None:
            kw[f.name] = val.astype(dtype)
        elif isinstance(val, LayerWeights):
            kw[f.name] = cast_matrices(val, dtype)
        elif isinstance(val, tuple):
            kw[f.name] = tuple(cast_matrices(lw, dtype) for lw in val)
    return dataclasses.replace(p, **kw)
