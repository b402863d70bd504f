#!/usr/bin/env bash
# The training corpus of issue 19: the target's own answers as token shards committed under
# train/corpus/ (so data generated in one session is kept for the next), then the features
# training reads, computed locally. Every step is resumable: rerun after an interruption and
# finished prompts / shards are kept. Run niced beside other work: `nice -n 10 scripts/corpus.sh`.
set -euo pipefail
C=${CORPUS:-train/corpus}
GEN=(python -m train datagen --tokens-only --dtype bfloat16 --batch 64 --max-new 192
     --out "$C/tokens")
# 1. Self-generated prompts (Magpie), seeded, deduplicated, held-out overlaps refused.
python -m train magpie --n 4000 --out "$C/magpie.jsonl"
# 2. Every shipped prompt set's training split: greedy + 3 samples at T = 1.
"${GEN[@]}" --samples 3
# 3. The Magpie prompts: greedy + 2 samples.
"${GEN[@]}" --samples 2 --prompts-file "$C/magpie.jsonl"
# 4. Held-out prompts (never trained on; held-out τ during training), greedy.
"${GEN[@]}" --modes greedy --split heldout --sets humaneval gsm8k mtbench
# 5. Features for training, locally (one batched target forward per shard).
python -m train featurize --tokens "$C/tokens" --out "${DATA:-runs/data}"
