"""Does a larger draft vocabulary raise τ of a trained drafter with no retraining? (issue 19)

A trained drafter's head rows are the target's embedding rows of its vocabulary, so its
vocabulary can grow without new parameters (`train.data.draft_vocab(..., keep=)`): this keeps
the shipped EAGLE-3's 4,096 tokens, adds the next most frequent response tokens of the training
corpus (`train/corpus/tokens`, held-out shards excluded) up to each size, and measures greedy τ
on held-out prompts (bfloat16 target, batch 1, K given, 96 tokens) per size.

    python scripts/grow_vocab_tau.py OUTDIR K SIZE [SIZE ...]
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import types
from pathlib import Path

import numpy as np

import jspec
from jspec.drafters.loading import ASSETS, SHIPPED
from jspec.drafters.trained import load_drafter_file, save_drafter
from jspec.prompts import load_prompt_set
from train.data import coverage, draft_vocab

PROMPTS = ("humaneval:0-8", "gsm8k:0-8", "mtbench:60-68")


def corpus_rows(heldout: bool, root: str = "train/corpus/tokens") -> types.SimpleNamespace:
    """(tokens, plens) of every training (or held-out) token shard's rows."""
    tokens, plens = [], []
    for f in sorted(Path(root).glob("*.npz")):
        if f.name.startswith("heldout") != heldout:
            continue
        z = np.load(f)
        tokens += [z["tokens"][a:b] for a, b in itertools.pairwise(z["offsets"])]
        plens += [int(p) for p in z["prompt_lens"]]
    return types.SimpleNamespace(tokens=tokens, plens=plens)


def main() -> None:
    out, k, sizes = Path(sys.argv[1]), int(sys.argv[2]), [int(s) for s in sys.argv[3:]]
    out.mkdir(parents=True, exist_ok=True)
    src = ASSETS / SHIPPED["smollm2-135m-eagle3"]
    cfg, params, vocab = load_drafter_file(src)
    rows, held = corpus_rows(False), corpus_rows(True)
    m = jspec.load_model("smollm2-135m").astype("bfloat16")
    prompts = {s: [np.asarray([m.encode(r["text"])]) for r in load_prompt_set(s)] for s in PROMPTS}
    for size in sizes:
        grown = vocab if size == len(vocab) else draft_vocab(rows, size, (), keep=vocab)
        path = out / f"eagle3-v{size}.safetensors"
        save_drafter(path, dataclasses.replace(cfg, draft_vocab=len(grown)), params,
                     grown)
        d = jspec.load_drafter(str(path), target=m)
        taus = []
        for s, ids in prompts.items():
            t = [float(jspec.generate(m, x, max_new_tokens=96, drafter=d,
                                      length=jspec.FixedLength(k)).stats.mean_accepted()[0])
                 for x in ids]
            taus.append(np.mean(t))
            print(f"vocab {size} K {k} {s}: tau {np.mean(t):.3f}", flush=True)
        print(f"vocab {size}: covers {coverage(held, grown):.1%} of held-out response tokens; "
              f"tau mean over the three kinds {np.mean(taus):.3f}", flush=True)


if __name__ == "__main__":
    main()
