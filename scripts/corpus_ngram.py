"""Would an n-gram table of the corpus's answers draft well? (issue 19; a measurement, no drafter)

Builds n-gram → next-token counts (n = 1..N, backing off from the longest n-gram seen) from the
training-split token shards of `train/corpus/tokens` (every shard not named `heldout_*`; the
prompt's last N tokens count as context), then drafts chains of up to 4 tokens along the
held-out greedy answers' first 96 tokens: at each position the table's most frequent
continuation, when it has at least `minc` observations and that continuation's share is at
least `thr`. Prints, per (thr, minc), the share of positions it drafts at all, the share whose
first drafted token is right, that precision, and the mean accepted length per position (the
τ − 1 a chain of these drafts alone would add).

    python scripts/corpus_ngram.py [N]
"""

from __future__ import annotations

import collections
import glob
import os
import sys
from collections.abc import Iterator

import numpy as np

TOKENS = os.path.join(os.path.dirname(__file__), "..", "train", "corpus", "tokens")


def sequences(pattern: str) -> Iterator[tuple[list[int], int]]:
    """(tokens, prompt length) of every sequence in the shards matching pattern."""
    for f in sorted(glob.glob(os.path.join(TOKENS, pattern))):
        z = np.load(f)
        t, off, plen = z["tokens"], z["offsets"], z["prompt_lens"]
        for i in range(len(plen)):
            yield t[off[i]:off[i + 1]].tolist(), int(plen[i])


def main(n_max: int) -> None:
    tables = {n: collections.defaultdict(collections.Counter) for n in range(1, n_max + 1)}
    train = [s for f in sorted(glob.glob(os.path.join(TOKENS, "*.npz")))
             if not os.path.basename(f).startswith("heldout")
             for s in sequences(os.path.basename(f))]
    print(f"{len(train)} training sequences, "
          f"{sum(len(t) - p for t, p in train)} response tokens")
    for t, p in train:
        r = t[max(p - n_max, 0):]
        for n, tab in tables.items():
            for i in range(n, len(r)):
                tab[tuple(r[i - n:i])][r[i]] += 1

    def predict(ctx: list[int], thr: float, minc: int) -> int | None:
        for n in range(n_max, 0, -1):
            c = tables[n].get(tuple(ctx[-n:]))
            if c:
                tot = sum(c.values())
                tok, cnt = c.most_common(1)[0]
                return tok if tot >= minc and cnt / tot >= thr else None
        return None

    held = list(sequences("heldout_*"))
    for thr in (0.5, 0.7, 0.9):
        for minc in (2, 5):
            drafted = first = total = 0
            accepted = []
            for t, p in held:
                for i in range(p, min(len(t), p + 96)):
                    total += 1
                    ctx, n_ok = t[:i], 0
                    for j in range(4):
                        tok = predict(ctx, thr, minc)
                        if tok is None:
                            break
                        drafted += j == 0
                        if i + j < len(t) and tok == t[i + j]:
                            n_ok += 1
                            ctx = [*ctx, tok]
                        else:
                            break
                    first += n_ok > 0
                    accepted.append(n_ok)
            print(f"N {n_max} thr {thr} minc {minc}: drafts at {drafted / total:.3f} of positions, "
                  f"first token right {first / total:.3f} (precision {first / max(drafted, 1):.3f}), "
                  f"mean accepted {np.mean(accepted):.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
