"""The transformer layer of jspec: config, weights, KV cache, forward, loading."""

from jspec.models.blocks import LayerWeights
from jspec.models.cache import KVCache
from jspec.models.config import ModelConfig
from jspec.models.llama import Chain, ForwardOutput, Tree, Weights, forward, init_weights
from jspec.models.model import Model, load_model

__all__ = ["Chain", "ForwardOutput", "KVCache", "LayerWeights", "Model", "ModelConfig", "Tree",
           "Weights", "forward", "init_weights", "load_model"]
