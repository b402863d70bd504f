#!/usr/bin/env bash
# The VAT ablation (DFlash; base / +head / +weighting / both) on a slice of the corpus, with two
# seeds: every greedy shard of the shipped sets' training splits (AlpacaEval, GSM8K, HumanEval,
# MT-Bench, generated math), the first T = 1 pass of AlpacaEval, GSM8K and HumanEval, and the
# held-out greedy shards (GSM8K 0-19, HumanEval 0-31, MT-Bench 60-79) for held-out tau.
# Resumable: featurize keeps finished shards, training resumes from its last checkpoint, and a
# finished variant (its drafter file written) is skipped. Results: runs/vabl-<variant>-s<seed>/
# log.jsonl (python scripts/vat_ablation_table.py prints the table). STEPS, SEEDS and VARIANTS
# (base head weight both) choose the runs.
set -euo pipefail
TOK=${TOK:-runs/tokabl}
DATA=${DATA:-runs/data}
STEPS=${STEPS:-120}
SEEDS=${SEEDS:-"0 1"}
VARIANTS=${VARIANTS:-"base head weight both"}
mkdir -p "$TOK"
for f in train/corpus/tokens/{heldout_*,*-greedy-*,alpaca-sample-*,gsm8k-sample-*,humaneval-sample-*}.npz; do
  case $(basename "$f") in magpie-*) continue;; esac
  ln -sf "$(readlink -f "$f")" "$TOK/"
done
ln -sf "$(readlink -f train/corpus/tokens/meta.json)" "$TOK/meta.json"
python -m train featurize --tokens "$TOK" --out "$DATA"
for seed in $SEEDS; do
  for v in $VARIANTS; do
    case $v in base) f="";; head) f="--vat-head";; weight) f="--vat-weight";; both) f="--vat";; esac
    out=runs/vabl-$v-s$seed
    [ -f "$out/dflash.safetensors" ] && continue
    python -m train dflash --data "$DATA" --out "$out" $f --seed "$seed" --steps "$STEPS" \
      --eval-every "$((STEPS / 2))" --ckpt-every 20
  done
done
echo ALLDONE
