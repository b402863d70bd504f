"""The committed training corpus (train/corpus/): clean prompts, well-formed token shards.

What is committed is what the next session trains on, so it is checked like code: the Magpie
prompts pass the filters that made them (no held-out overlap, not degenerate, no near-duplicates)
and every token shard is a valid `train.datagen.Shard` without features whose training rows
never reuse a held-out prompt. Skipped where the corpus is absent.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from train.datagen import load_shard
from train.magpie import Dedup, HeldOut, degenerate, heldout_texts

CORPUS = Path(__file__).resolve().parents[1] / "train" / "corpus"
VOCAB = 49152  # SmolLM2's


def _shards() -> list[Path]:
    return sorted(p for p in (CORPUS / "tokens").glob("*.npz") if ".tmp" not in p.name)


def test_committed_magpie_prompts_pass_their_filters():
    path = CORPUS / "magpie.jsonl"
    assert path.exists(), "train/corpus/magpie.jsonl is committed; it must not go missing"
    texts = [json.loads(x)["text"] for x in path.read_text().splitlines() if x.strip()]
    held, dedup = HeldOut(heldout_texts()), Dedup()
    assert texts
    assert not [t for t in texts if held.overlaps(t)]
    assert not [t for t in texts if degenerate(t)]
    assert all(dedup.add(t) for t in texts)


def test_committed_token_shards_are_well_formed():
    files = _shards()
    assert files, "train/corpus/tokens/ is committed; its shards must not go missing"
    meta = json.loads((CORPUS / "tokens" / "meta.json").read_text())
    assert meta["tokens_only"] and meta["model"] == "smollm2-135m"
    held_prompts, train_prompts = set(), set()
    for f in files:
        sh = load_shard(f)
        assert sh.feats is None, f
        offs, plens = sh.offsets, sh.prompt_lens
        assert offs[0] == 0 and offs[-1] == len(sh.tokens) and np.all(np.diff(offs) > 0), f
        assert len(plens) == len(offs) - 1 and np.all(plens >= 1), f
        assert np.all(plens < np.diff(offs)), f  # every row has a response token
        assert sh.tokens.min() >= 0 and sh.tokens.max() < VOCAB, f
        prompts = {tuple(sh.tokens[a:a + n]) for a, n in zip(offs[:-1], plens, strict=True)}
        (held_prompts if f.name.startswith("heldout_") else train_prompts).update(prompts)
    assert not held_prompts & train_prompts
