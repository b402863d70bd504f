"""safetensors files, read and written in one place (numpy, no torch).

Reads any dtype the format names (bfloat16 through ml_dtypes: the `safetensors` package's numpy
reader refuses it), memory-mapped; writes through `safetensors.numpy` with string metadata, to a
temporary name first and then renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from jspec.errors import JspecError

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
           "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
           "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
           "BOOL": np.bool_}


def _header(path: Path) -> tuple[np.memmap, int, dict]:
    try:
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        (n,) = struct.unpack("<Q", bytes(raw[:8]))
        return raw, n, json.loads(bytes(raw[8:8 + n]))
    except (OSError, ValueError, struct.error) as e:
        raise JspecError(f"cannot read {path} (not safetensors?): {e}") from e


def read_metadata(path: str | Path) -> dict[str, str]:
    """The file's string metadata (`__metadata__`; {} when it has none)."""
    return dict(_header(Path(path))[2].get("__metadata__") or {})


def read(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as numpy, memory-mapped (read-only views)."""
    path = Path(path)
    raw, n, header = _header(path)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _DTYPES.get(info.get("dtype"))
        if dt is None:
            raise JspecError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')}")
        a, b = info["data_offsets"]
        out[name] = np.asarray(raw[8 + n + a: 8 + n + b].view(dt).reshape(info["shape"]))
    return out


def write(path: str | Path, tensors: dict[str, np.ndarray],
          metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (any numpy dtype safetensors has) with `metadata`, atomically; parent
    directories are made."""
    from safetensors.numpy import save_file  # noqa: PLC0415 (only when writing)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp),
              metadata=metadata)
    os.replace(tmp, path)
