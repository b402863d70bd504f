"""`Model`: config (static) + weights (pytree) + tokenizer, and `load_model`."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jspec.errors import JspecError, ModelLoadError
from jspec.models import loading, registry
from jspec.models.config import ModelConfig
from jspec.models.llama import Weights, cast_weights, stack_layers, unstack_layers


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A loaded model. A pytree: `weights` are its leaves; `config` and `tokenizer` are static."""

    config: ModelConfig
    weights: Weights
    tokenizer: Any = None
    name: str = ""

    def tree_flatten(self):
        return (self.weights,), (self.config, _Opaque(self.tokenizer), self.name)

    @classmethod
    def tree_unflatten(cls, aux, children):
        config, tok, name = aux
        return cls(config=config, weights=children[0], tokenizer=tok.value, name=name)

    def astype(self, dtype: str) -> Model:
        """The same model with weights and activations in `dtype` ("float32" / "bfloat16")."""
        config = self.config.replace(dtype=dtype)
        return dataclasses.replace(self, config=config,
                                   weights=cast_weights(self.weights, config.jnp_dtype))

    def with_attention_impl(self, impl: str) -> Model:
        """The same model with `config.attention_impl = impl` ("auto" | "xla" | "pallas")."""
        return dataclasses.replace(self, config=self.config.replace(attention_impl=impl))

    def with_scan_layers(self, on: bool = True) -> Model:
        """The same model with its layers stacked and scanned (`ModelConfig.scan_layers`: the
        layout for TPU) or, with on=False, one buffer per layer, unrolled (for CPU)."""
        weights = (stack_layers if on else unstack_layers)(self.weights)
        return dataclasses.replace(self, config=self.config.replace(scan_layers=on),
                                   weights=weights)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.config.eos_ids

    @property
    def pad_id(self) -> int | None:
        """The tokenizer's padding token id (SmolLM2: 2, its EOS), or None without a tokenizer
        or a pad token. Only input checks read it: jspec's own padding is masked, not matched."""
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return None if pad is None else int(pad)

    def encode(self, text: str, *, chat: bool = True) -> list[int]:
        """Token ids of `text`, through the chat template (one user turn) unless chat=False."""
        if self.tokenizer is None:
            raise JspecError("this model has no tokenizer; pass token ids instead")
        if not isinstance(text, str) or not text.strip():
            raise JspecError("the prompt is empty")
        if chat and getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, ids: Any) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1) if int(i) >= 0]
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class _Opaque:
    """Wraps a non-hashable static value; equal only to the same object."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


jax.tree_util.register_pytree_node(Model, Model.tree_flatten, Model.tree_unflatten)


def load_model(name_or_path: str | os.PathLike, *, dtype: str = "float32",
               scan_layers: bool = False) -> Model:
    """Load a model by registry name, `.gguf` file, or Hugging Face directory.

    Args:
      name_or_path: e.g. "smollm2-135m", "/path/model.gguf", "/path/hf_dir".
      dtype: "float32" (default; fastest on CPU) or "bfloat16" (TPU/GPU).
      scan_layers: stack the layers and scan them (`ModelConfig.scan_layers`): the layout for
        TPU (a program compiles several times faster and reads its byte floor, docs/TPU.md);
        the default, per-layer buffers, is the layout for CPU. A loaded model converts with
        `Model.with_scan_layers`.
    Returns:
      Model with config, weights and tokenizer.
    """
    name = str(name_or_path)
    path = Path(name).expanduser()
    if name in registry.REGISTRY:
        src = registry.converted_dir(registry.REGISTRY[name])
        config, tensors, tok = loading.read_hf_dir(src)
    elif path.suffix == ".gguf" or path.is_file():
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        config, tensors, tok = loading.read_gguf(path)
    elif path.is_dir():
        config, tensors, tok = loading.read_hf_dir(path)
    else:
        known = ", ".join(sorted(registry.REGISTRY))
        raise ModelLoadError(
            f"unknown model {name!r}: not a registry name ({known}), a .gguf file or an HF directory")
    config = config.replace(dtype=dtype)
    weights = loading.weights_from_hf(config, tensors)
    model = Model(config=config, weights=weights, tokenizer=tok, name=name)
    return model.with_scan_layers() if scan_layers else model
