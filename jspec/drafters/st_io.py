"""safetensors files without torch: read any dtype (bfloat16 through ml_dtypes), write
float/int arrays; the community checkpoint layouts' shared names (`jspec.drafters.interop`)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from jspec.errors import JspecError

FORMATS = ("eagle3", "dflash")
EXTRA_FILE = "jspec_extra.safetensors"  # jspec's additions, outside the engines' tensor files
WEIGHTS_FILE = "model.safetensors"
# Bookkeeping fields that do not change what the drafter computes.
IGNORED = frozenset({
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "initializer_range",
    "use_cache", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id",
    "tie_word_embeddings", "max_window_layers", "auto_map", "max_position_embeddings",
    "use_return_dict", "output_hidden_states"})

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
              "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
              "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


# ----------------------------------------------------------------------------- safetensors
def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as numpy (bfloat16 through ml_dtypes: the numpy
    reader of the `safetensors` package refuses it)."""
    path = Path(path)
    try:
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        (n,) = struct.unpack("<Q", bytes(raw[:8]))
        header = json.loads(bytes(raw[8:8 + n]))
    except (OSError, ValueError, struct.error) as e:
        raise JspecError(f"cannot read {path} (not safetensors?): {e}") from e
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _ST_DTYPES.get(info.get("dtype"))
        if dt is None:
            raise JspecError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')}")
        a, b = info["data_offsets"]
        buf = raw[8 + n + a: 8 + n + b]
        out[name] = np.asarray(buf.view(dt).reshape(info["shape"]))
    return out


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """safetensors with the `format: pt` metadata that transformers' loader asks for."""
    from safetensors.numpy import save_file  # noqa: PLC0415 (only when writing)

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})


def _read_dir_tensors(path: Path) -> dict[str, np.ndarray]:
    files = sorted(f for f in path.glob("*.safetensors") if f.name != EXTRA_FILE)
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = f" ({', '.join(bins)}: convert it to safetensors first)" if bins else ""
        raise JspecError(f"{path} has no *.safetensors weights{hint}")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(read_safetensors(f))
    return tensors


# ----------------------------------------------------------------------------- config reading
