"""safetensors files without torch: read any dtype (bfloat16 through ml_dtypes), write
float/int arrays; the community checkpoint layouts' shared names (`jspec.drafters.interop`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jspec import safetensors_io
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



# ----------------------------------------------------------------------------- safetensors
read_safetensors = safetensors_io.read  # every tensor, any dtype (bfloat16 through ml_dtypes)


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """safetensors with the `format: pt` metadata that transformers' loader asks for."""
    safetensors_io.write(path, tensors, {"format": "pt"})


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
