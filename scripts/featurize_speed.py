"""Tokens/s of `train featurize` on the real target (docs/BENCHMARKS.md, the corpus section).

    python scripts/featurize_speed.py [DTYPE]     (default float32)

A synthetic 64-row shard (rows of 150-330 random tokens, seed 0) through `featurize_shard`,
timed after one warm-up pass (compiles excluded).
"""

import sys
import time

import numpy as np

from jspec.models.model import load_model
from train.datagen import FEATURE_LAYERS, Shard
from train.featurize import featurize_shard

model = load_model("smollm2-135m", dtype=sys.argv[1] if len(sys.argv) > 1 else "float32")
rng = np.random.default_rng(0)
lens = rng.integers(150, 330, 64)
offs = np.concatenate([[0], np.cumsum(lens)])
shard = Shard(tokens=rng.integers(0, 49152, offs[-1]).astype(np.int32), offsets=offs,
              prompt_lens=np.full(64, 40, np.int32), feats=None)
featurize_shard(model, shard, FEATURE_LAYERS)
t = time.perf_counter()
featurize_shard(model, shard, FEATURE_LAYERS)
print(f"featurize_shard: {offs[-1] / (time.perf_counter() - t):.0f} tokens/s")
