"""jspec: JAX-native speculative decoding."""

from jspec import sharding
from jspec.decode import generate, stream
from jspec.drafters import DraftModel, NGram, bind, load_drafter
from jspec.errors import JspecError, ModelLoadError, PlainDecodingWarning
from jspec.inputs import bucket_prompts
from jspec.length import FixedLength, LibraSpec
from jspec.models import Chain, KVCache, Model, ModelConfig, Tree, Weights, forward, load_model
from jspec.sampling import Sampling, SamplingParams
from jspec.scoring import logprobs
from jspec.state import GenerateOutput, SpecState, Stats
from jspec.verify import ASD, Diversed, DiversedHead, Lossless

__all__ = [
           "ASD",
           "Chain",
           "Diversed",
           "DiversedHead",
           "DraftModel",
           "FixedLength",
           "GenerateOutput",
           "JspecError",
           "KVCache",
           "LibraSpec",
           "Lossless",
           "Model",
           "ModelConfig",
           "ModelLoadError",
           "NGram",
           "PlainDecodingWarning",
           "Sampling",
           "SamplingParams",
           "SpecState",
           "Stats",
           "Tree",
           "Weights",
           "bind",
           "bucket_prompts",
           "forward",
           "generate",
           "load_drafter",
           "load_model",
           "logprobs",
           "sharding",
           "stream",
]
