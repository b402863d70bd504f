"""jspec: JAX-native speculative decoding."""

from jspec.decode import DecodeState, GenerateOutput, Stats, generate
from jspec.errors import JspecError, ModelLoadError
from jspec.models import Chain, KVCache, Model, ModelConfig, Tree, Weights, forward, load_model
from jspec.sampling import Sampling

__all__ = ["Chain", "DecodeState", "GenerateOutput", "JspecError", "KVCache", "Model",
           "ModelConfig", "ModelLoadError", "Sampling", "Stats", "Tree", "Weights", "forward",
           "generate", "load_model"]
