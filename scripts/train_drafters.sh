#!/usr/bin/env bash
# The recipe that produced jspec/assets/smollm2-135m-{eagle3,dflash}.safetensors on the 2-core
# CPU machine (timings in README / docs/BENCHMARKS.md). Every step is resumable: rerun the script
# after an interruption and finished shards / checkpoints are kept.
set -euo pipefail
DATA=${DATA:-runs/data}
# 1. The target's own responses (greedy + sampled T=1) with its hidden states, training split.
python -m train datagen --out "$DATA" --sets humaneval --modes greedy sample --batch 32
python -m train datagen --out "$DATA" --sets math --modes greedy --batch 32
# 2. Held-out prompts (never trained on): greedy responses for the simulated-τ evaluation.
python -m train datagen --out "$DATA" --sets humaneval math --modes greedy --batch 32 --split heldout
# 3. The drafters (VAT on).
python -m train dflash --data "$DATA" --out runs/dflash --vat --steps "${DFLASH_STEPS:-400}"
python -m train eagle3 --data "$DATA" --out runs/eagle3 --vat --steps "${EAGLE_STEPS:-200}"
cp runs/dflash/dflash.safetensors jspec/assets/smollm2-135m-dflash.safetensors
cp runs/eagle3/eagle3.safetensors jspec/assets/smollm2-135m-eagle3.safetensors
