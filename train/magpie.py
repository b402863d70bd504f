"""`python -m train magpie`: prompts the target writes itself (the Magpie technique).

Given only the chat template up to the start of a user turn (for SmolLM2: its default system
turn, then `<|im_start|>user\\n`), the instruction-tuned target samples a user message (T = 1)
until it closes the turn. The messages are filtered and written as JSONL (`{"text": ...}`),
ready for `python -m train datagen --prompts-file`:
- length: 4..200 words, and the turn must have ended (a message cut by the token limit is
  dropped);
- degenerate repeats: a word 3-gram seen 3 or more times, or under 40% distinct words;
- near-duplicates: word 3-gram Jaccard similarity >= 0.6 with a kept message;
- held-out overlap: any word 8-gram shared with a held-out prompt (every held-out split of
  `train.datagen.SPLITS`, which contains the benchmarks' prompts) is refused.
Seeded (batch j samples with `fold_in(key(seed), j)`) and resumable: the output is appended to
batch by batch and the batch counter is kept in `<out>.state.json`, so a rerun continues.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

import jspec
from jspec.prompts import load_prompt_set
from train.datagen import SPLITS

SENTINEL = "\u2063MAGPIE\u2063"
OVERLAP_N = 8  # word n-gram length of the held-out overlap check
DUP_JACCARD = 0.6


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(ws: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)}


class HeldOut:
    """Word 8-grams of the held-out prompts: `overlaps(text)` is True when any is shared."""

    def __init__(self, texts: Iterable[str], n: int = OVERLAP_N) -> None:
        self.n = n
        self.grams: set[tuple[str, ...]] = set()
        for t in texts:
            self.grams |= ngrams(words(t), n)

    def overlaps(self, text: str) -> bool:
        return not ngrams(words(text), self.n).isdisjoint(self.grams)


def degenerate(text: str) -> bool:
    ws = words(text)
    if len(ws) < 4 or len(ws) > 200:
        return True
    if len(set(ws)) < 0.4 * len(ws):
        return True
    tri = Counter(tuple(ws[i:i + 3]) for i in range(len(ws) - 2))
    return bool(tri) and max(tri.values()) >= 3


class Dedup:
    """Keeps a message unless its word 3-grams are >= `threshold` Jaccard-similar to a kept one."""

    def __init__(self, threshold: float = DUP_JACCARD) -> None:
        self.threshold = threshold
        self.kept: list[set[tuple[str, ...]]] = []
        self.index: dict[tuple[str, ...], list[int]] = {}

    def add(self, text: str) -> bool:
        g = ngrams(words(text), 3)
        if not g:
            return False
        cand = Counter(i for x in g for i in self.index.get(x, ()))
        for i, shared in cand.items():
            if shared / len(g | self.kept[i]) >= self.threshold:
                return False
        self.kept.append(g)
        for x in g:
            self.index.setdefault(x, []).append(len(self.kept) - 1)
        return True


def heldout_texts() -> list[str]:

    return [r["text"] for held, _ in SPLITS.values() for r in load_prompt_set(held)]


def pre_query_ids(model: Any) -> list[int]:
    """Token ids of the chat template up to (and including) the start of a user message."""
    tok = model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                   add_generation_prompt=False)
    if SENTINEL not in text:
        raise SystemExit("error: the chat template does not place the user message verbatim")
    return tok.encode(text.split(SENTINEL)[0], add_special_tokens=False)


def run(args: argparse.Namespace) -> int:


    out = Path(args.out)
    state_path = out.with_suffix(out.suffix + ".state.json")
    state = json.loads(state_path.read_text()) if state_path.exists() else {
        "seed": args.seed, "batches": 0}
    if state["seed"] != args.seed:
        raise SystemExit(f"error: {out} was made with seed {state['seed']}; use another --out")
    kept = [json.loads(x)["text"] for x in out.read_text().splitlines()] if out.exists() else []
    model = jspec.load_model(args.model, dtype=args.dtype)
    held = HeldOut(heldout_texts())
    dedup = Dedup()
    for t in kept:
        dedup.add(t)
    prefix = pre_query_ids(model)
    ids = np.asarray([prefix] * args.batch, np.int32)
    sampling = jspec.Sampling(temperature=1.0)
    counts = Counter()
    bar = tqdm(total=args.n, initial=min(len(kept), args.n), unit="prompt", dynamic_ncols=True)
    while len(kept) < args.n:
        key = jax.random.fold_in(jax.random.key(args.seed), state["batches"])
        res = jspec.generate(model, ids, max_new_tokens=args.max_new, sampling=sampling, key=key)
        toks, lens = np.asarray(res.tokens), np.asarray(res.lengths)
        new = []
        for r in range(args.batch):
            row = toks[r, :lens[r]].tolist()
            if not row or row[-1] not in model.eos_ids:
                counts["unfinished"] += 1
                continue
            text = model.decode(row).strip()
            if degenerate(text):
                counts["degenerate"] += 1
            elif held.overlaps(text):
                counts["held-out overlap"] += 1
            elif not dedup.add(text):
                counts["near-duplicate"] += 1
            else:
                new.append(text)
        with out.open("a") as f:
            for t in new:
                f.write(json.dumps({"text": t}) + "\n")
        kept += new
        state["batches"] += 1
        state_path.write_text(json.dumps(state))
        bar.update(min(len(new), max(args.n - bar.n, 0)))
        bar.set_postfix(dict(counts))
    bar.close()
    print(f"magpie: {len(kept)} prompts in {out}; dropped: {dict(counts)}", flush=True)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("magpie", help="self-generated training prompts (Magpie): the target "
                       "writes user turns from the chat template's user-turn prefix")
    p.add_argument("--model", default="smollm2-135m", help="target model")
    p.add_argument("--out", default="runs/magpie.jsonl", help="JSONL to append to")
    p.add_argument("--n", type=int, default=4000, help="prompts to keep (default 4000)")
    p.add_argument("--batch", type=int, default=64, help="messages sampled per batch")
    p.add_argument("--max-new", type=int, default=96, help="most tokens of a message")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                   help="target dtype while sampling prompts (default bfloat16, the faster "
                        "batched here)")
    p.set_defaults(func=run)
