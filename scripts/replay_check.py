"""The replay against real decoding on the real target (docs/BENCHMARKS.md, "Held-out τ that is
decoding's τ"): greedy speculative decoding of held-out HumanEval prompts with a trained drafter
at K, then `train.drafters.replay_rounds` along the text it produced; prints both (emitted
tokens, rounds) per prompt.

    python scripts/replay_check.py [DRAFTER] [K] [PROMPTS]
      (defaults: smollm2-135m-eagle3, 3, 4: the first rows of the held-out HumanEval shard)
"""

import sys

import jax.numpy as jnp
import numpy as np

import jspec
from jspec.drafters.loading import drafter_file
from jspec.drafters.trained import Frozen, load_drafter_file, split_frozen
from train.drafters import drafts_along, replay_rounds
from train.featurize import features_of, width_of

name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-eagle3"
k = int(sys.argv[2]) if len(sys.argv) > 2 else 3
count = int(sys.argv[3]) if len(sys.argv) > 3 else 4
model = jspec.load_model("smollm2-135m")
drafter = jspec.load_drafter(name, target=model)
cfg, params, vocab = load_drafter_file(drafter_file(name))
params, stats = split_frozen(params)
frozen = Frozen.of(model.weights.embed, vocab, stats)
shard = np.load("train/corpus/tokens/heldout_humaneval-greedy-0000.npz")
offs, plens, toks = shard["offsets"], shard["prompt_lens"], shard["tokens"]
for i in range(count):
    prompt = toks[offs[i]:offs[i] + plens[i]].astype(np.int32)
    out = jspec.generate(model, jnp.asarray(prompt)[None], drafter=drafter, max_new_tokens=96,
                         length=jspec.FixedLength(k))
    seq = np.concatenate([prompt, np.asarray(out.tokens[0, : int(out.lengths[0])])])
    ids = np.zeros((1, width_of(len(seq))), np.int32)
    ids[0, : len(seq)] = seq
    f = np.asarray(features_of(model.weights, jnp.asarray(ids), config=model.config,
                               layers=tuple(cfg.feature_layers)))
    b = {"tokens": ids, "feats": f[:, :, :-1], "lens": np.asarray([len(seq)], np.int32),
         "plens": np.asarray([len(prompt)], np.int32)}
    d = drafts_along(params, frozen, b, cfg)[0][: len(seq), :k]
    replayed = replay_rounds(np.asarray(frozen.to_draft)[seq], d, len(prompt) + 1)
    decoded = (int(out.stats.emitted[0]), int(out.stats.rounds[0]))
    print(f"prompt {i}: decoding (emitted, rounds) {decoded}, replay {replayed}, "
          f"{'equal' if decoded == replayed else 'DIFFERENT'}", flush=True)
