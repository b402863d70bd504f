#!/usr/bin/env bash
# The recipe that produced jspec/assets/smollm2-135m-{eagle3,dflash}.safetensors on the 2-core
# CPU machine (wall times in docs/BENCHMARKS.md). Every step is resumable: rerun the script after
# an interruption and finished shards / checkpoints are kept.
set -euo pipefail
DATA=${DATA:-runs/data}
# 1. The target's own responses with its hidden states, training split (HumanEval 32-163 greedy
#    and sampled at T=1, generated math 64-363 greedy).
python -m train datagen --out "$DATA" --sets humaneval --modes greedy sample --batch 32
python -m train datagen --out "$DATA" --sets math --modes greedy --batch 32
# 2. Held-out prompts (HumanEval 0-31, math 0-63; never trained on), greedy, for held-out τ.
python -m train datagen --out "$DATA" --sets humaneval math --modes greedy --batch 32 --split heldout
# 3. The drafters, with VAT.
python -m train eagle3 --data "$DATA" --out runs/eagle3 --vat --steps 700 --eval-every 100
python -m train dflash --data "$DATA" --out runs/dflash --vat --steps 300 --eval-every 100
cp runs/eagle3/eagle3.safetensors jspec/assets/smollm2-135m-eagle3.safetensors
cp runs/dflash/dflash.safetensors jspec/assets/smollm2-135m-dflash.safetensors
