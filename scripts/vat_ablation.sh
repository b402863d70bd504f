#!/usr/bin/env bash
# The small-scale VAT ablation of docs/BENCHMARKS.md (DFlash; base / +head / +weighting / both).
set -e
D=runs/abl-data
python -m train datagen --out $D --sets humaneval --modes greedy --batch 32 --split heldout
python -m train datagen --out $D --sets humaneval --modes greedy --batch 32
for v in base head weight both; do
  case $v in base) f="";; head) f="--vat-head";; weight) f="--vat-weight";; both) f="--vat";; esac
  python -m train dflash --data $D --out runs/abl-$v $f --steps 80 --eval-every 80 --ckpt-every 40
done
echo ALLDONE
