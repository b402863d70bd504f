"""Share of the target's response tokens outside a drafter's draft vocabulary, on the held-out
greedy answers of the corpus (train/corpus/tokens/heldout_<set>-greedy-*.npz).
`python scripts/draft_vocab_coverage.py [DRAFTER.safetensors]` (default: the shipped EAGLE-3)."""

from __future__ import annotations

import glob
import sys

import numpy as np
from safetensors.numpy import load_file


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "jspec/assets/smollm2-135m-eagle3.safetensors"
    vocab = load_file(path)["vocab_ids"]
    for name in ("humaneval", "gsm8k", "mtbench"):
        resp = []
        for f in sorted(glob.glob(f"train/corpus/tokens/heldout_{name}-greedy-*.npz")):
            z = np.load(f)
            t, o, pl = z["tokens"], z["offsets"], z["prompt_lens"]
            resp += [t[o[i] + pl[i]:o[i + 1]] for i in range(len(pl))]
        r = np.concatenate(resp)
        print(f"{name}: {r.size} response tokens, {1 - np.isin(r, vocab).mean():.1%} outside "
              f"the {vocab.size}-token draft vocabulary")


if __name__ == "__main__":
    main()
