"""Greedy decoding's τ of a trained drafter on the held-out greedy answers, at several K, without
decoding (docs/BENCHMARKS.md, "Held-out τ that is decoding's τ").

    python scripts/replay_tau.py DRAFTER.safetensors [DATA] [KS]
      (defaults: runs/data, 1,2,3,4; DRAFTER may be a shipped name, e.g. smollm2-135m-eagle3)

Every held-out row of DATA (its heldout_* feature shards: the target's greedy answers) goes
through the drafter once (`train.drafters.drafts_along`: the drafter's greedy draft from every
position, as decoding drafts it); `replay_rounds` then walks each row round by round as greedy
speculative decoding at K would (tested equal, row by row, to `jspec.generate`'s rounds). Prints
τ = tokens per round pooled over the rows, per K, for the whole set and per prompt set. EAGLE-3
chains past its trained length run on (as decoding at that K does); DFlash drafts at most its
block - 1 tokens.
"""

import dataclasses
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from jspec.drafters.loading import drafter_file
from jspec.drafters.trained import Frozen, load_drafter_file, split_frozen
from jspec.models.model import load_model
from train.data import data_layers, load_rows, make_batch
from train.drafters import drafts_along, replay_rounds

src = sys.argv[1]
path = drafter_file(src)
data = sys.argv[2] if len(sys.argv) > 2 else "runs/data"
ks = [int(k) for k in (sys.argv[3] if len(sys.argv) > 3 else "1,2,3,4").split(",")]
cfg, params, vocab = load_drafter_file(path)
kmax = max(ks)
if cfg.kind == "eagle3":
    cfg = dataclasses.replace(cfg, block=max(kmax, cfg.block))
elif kmax > cfg.block - 1:
    raise SystemExit(f"error: a DFlash block of {cfg.block} drafts at most {cfg.block - 1}")
model = load_model("smollm2-135m")
params, stats = split_frozen(params)
frozen = Frozen.of(model.weights.embed, vocab, stats)
to_draft = np.asarray(frozen.to_draft)
recorded = data_layers(data)
cols = [recorded.index(i) for i in cfg.feature_layers]
feat_idx = list(range(len(cols)))
files = sorted(Path(data).glob("heldout_*.npz"))
tot: dict[str, np.ndarray] = defaultdict(lambda: np.zeros((len(ks), 2), np.int64))
for f in files:
    name = f.name.removeprefix("heldout_").split("-")[0]
    rows = load_rows(data, heldout=True, sets=[name], layers=cols)
    for i in range(len(rows)):
        n = len(rows.tokens[i])
        seq = -(-n // 64) * 64  # whole rows: no window
        b = make_batch(rows, [i], seq, feat_idx)
        d = drafts_along(params, frozen, b, cfg)[0]
        for j, k in enumerate(ks):
            e, r = replay_rounds(to_draft[rows.tokens[i]], d[:n, :k], rows.plens[i] + 1)
            tot[name][j] += (e, r)
            tot["all"][j] += (e, r)
print(f"{path}: held-out greedy τ (tokens per round), {len(files)} shards")
print("| set | " + " | ".join(f"K = {k}" for k in ks) + " |")
print("|---" * (len(ks) + 1) + "|")
for name, t in sorted(tot.items(), key=lambda x: (x[0] == "all", x[0])):
    print(f"| {name} | " + " | ".join(f"{e / max(r, 1):.3f}" for e, r in t) + " |")
