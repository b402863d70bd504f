"""Training data of the drafters: datagen shards as token rows + cached target features,
the draft vocabulary, feature statistics, and length-bucketed batches (`Batch`; functions of
(seed, step), so a resumed run draws the batches the uninterrupted one would have)."""

from __future__ import annotations

import dataclasses
import glob
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from train.datagen import load_shard


def data_layers(data: str) -> tuple[int, ...]:
    """The feature layers recorded in a datagen directory (meta.json)."""
    meta = Path(data) / "meta.json"
    if not meta.is_file():
        raise SystemExit(f"error: {meta} not found (run `python -m train datagen` first)")
    m = json.loads(meta.read_text())
    if m.get("tokens_only") or m.get("feature_layers") is None:
        raise SystemExit(f"error: {data} holds token shards without features (datagen "
                         f"--tokens-only); run `python -m train featurize --tokens {data} --out "
                         "DIR` and train on DIR")
    return tuple(m["feature_layers"])


def eagle_layers(layers: tuple[int, ...]) -> tuple[int, ...]:
    """Low / mid / high: the first, middle and last recorded layers (1, 14, 27 by default)."""
    return (layers[0], layers[len(layers) // 2], layers[-1])


# ----------------------------------------------------------------------------- data
@dataclasses.dataclass
class Rows:
    """Training sequences held in memory (features as stored: float16)."""

    tokens: list[np.ndarray]  # i32[n]
    plens: list[int]
    feats: list[np.ndarray]  # f16[n, F, D] (FEATURE_LAYERS then final-normed)

    def __len__(self) -> int:
        return len(self.tokens)


def load_rows(data: str, heldout: bool, sets: list[str] | None = None,
              layers: list[int] | None = None) -> Rows:
    """The training (or held-out) rows of a datagen directory.

    layers: the recorded feature columns to keep (indices into meta.json's feature_layers; the
      final-normed column, the last, is always kept after them); None keeps every column. A
      drafter reads three of the five recorded layers, so keeping only its columns holds 4/6 of
      the memory (the rows live in RAM: ≈ 4.6 KB a token instead of 6.9 KB).
    """
    files = sorted(f for f in glob.glob(str(Path(data) / "*.npz"))
                   if not f.endswith(".tmp.npz"))  # a write cut short by a kill
    files = [f for f in files if Path(f).name.startswith("heldout_") == heldout]
    if sets:
        files = [f for f in files if Path(f).name.split("-")[0].removeprefix("heldout_") in sets]
    if not files:
        raise SystemExit(f"error: no {'held-out' if heldout else 'training'} shards in {data} "
                         "(run `python -m train datagen` first)")
    toks, plens, feats = [], [], []
    for f in files:
        sh = load_shard(Path(f))
        cols = None if layers is None else [*layers, sh.feats.shape[1] - 1]
        for r in range(len(sh.prompt_lens)):
            a, b = int(sh.offsets[r]), int(sh.offsets[r + 1])
            if b - a - int(sh.prompt_lens[r]) < 2:
                continue
            toks.append(np.asarray(sh.tokens[a:b]))
            plens.append(int(sh.prompt_lens[r]))
            feats.append(np.asarray(sh.feats[a:b]) if cols is None
                         else np.ascontiguousarray(sh.feats[a:b][:, cols]))
    return Rows(toks, plens, feats)


def feature_stats(rows: Rows, feat_idx: list[int], seed: int, n: int = 50_000
                  ) -> dict[str, jax.Array]:
    """Per (layer, dim) mean and std of the features over a sample of positions."""
    rng = np.random.default_rng(seed)
    per = max(1, n // max(len(rows), 1))
    xs = []
    for f in rows.feats:
        idx = rng.choice(len(f) - 1, min(per, len(f) - 1), replace=False)  # last slot is empty
        xs.append(np.asarray(f[idx][:, feat_idx], np.float32))
    x = np.concatenate(xs)
    return {"feat_mean": jnp.asarray(x.mean(0)), "feat_std": jnp.asarray(x.std(0) + 1e-3)}


def response_counts(tokens: list[np.ndarray], plens: list[int] | np.ndarray) -> np.ndarray:
    """i64[max id + 1]: how often each token id occurs in the responses (after each prompt)."""
    counts = np.zeros((max(int(t.max()) for t in tokens) + 1,), np.int64)
    for t, p in zip(tokens, plens, strict=True):
        np.add.at(counts, t[p:], 1)
    return counts


def draft_vocab(rows: Rows, size: int, eos_ids: tuple[int, ...],
                keep: np.ndarray | None = None) -> np.ndarray:
    """The `size` most frequent response tokens (EOS always in), sorted ids.

    `keep` (a trained drafter's vocabulary, at most `size` ids): every one of them stays, and
    the most frequent others fill the rest — a drafter's head rows are the target's embedding
    rows of its vocabulary, so a larger vocabulary needs no new parameters."""
    order = [int(i) for i in np.argsort(-response_counts(rows.tokens, rows.plens), kind="stable")]
    if keep is not None:
        if len(keep) > size:
            raise ValueError(f"cannot shrink a vocabulary of {len(keep)} to {size}")
        have = set(int(i) for i in keep)
        return np.sort(np.asarray(sorted(have) + [i for i in order if i not in have][
            : size - len(have)], np.int32))
    out = order[:size]
    for e in eos_ids:
        if e not in out:
            out[-1] = e
    return np.sort(np.asarray(out, np.int32))


def coverage(rows: Rows, vocab: np.ndarray) -> float:
    v = set(vocab.tolist())
    tot = hit = 0
    for t, p in zip(rows.tokens, rows.plens, strict=True):
        r = t[p:]
        tot += len(r)
        hit += sum(1 for x in r.tolist() if x in v)
    return hit / max(tot, 1)


def window(n: int, plen: int, seq: int) -> tuple[int, int]:
    """(first kept token, prompt length kept) of an n-token row with a plen-token prompt in a
    seq-token batch: rows longer than seq keep their last seq tokens."""
    off = max(0, n - seq)
    return off, max(1, plen - off)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """A drafter training batch: host NumPy arrays from `make_batch`, the same pytree of
    device arrays once placed (`train.batches.to_device`; rows over `data` on a mesh).

    A pytree of arrays only (every field is data): the shapes (B rows, S the sequence bucket,
    N positions a row) are what a jitted step compiles for. The fields a step does not read
    may be None.
    """

    tokens: Any  # i32[B, S] right-padded rows (a row longer than S keeps its last S tokens)
    lens: Any  # i32[B] tokens kept per row
    plens: Any  # i32[B] prompt tokens kept per row (>= 1)
    feats: Any  # f16[B, S, F, D] the target's features at the drafter's F layers
    final: Any  # f16[B, S, D] the target's final-normed hidden state
    pos: Any = None  # i32[B, N] sampled chain starts (EAGLE-3) / block anchors (DFlash, D²SD)
    valid: Any = None  # bool[B, N] which of `pos` are real (a short row has fewer)
    prefix: Any = None  # i32[B, N] D²SD only: the known slots of each block

    def at(self, pos: Any, valid: Any, prefix: Any = None) -> Batch:
        """The batch with its sampled positions pos i32[B, N], valid bool[B, N] (and D²SD's
        prefix lengths i32[B, N])."""
        return dataclasses.replace(self, pos=pos, valid=valid, prefix=prefix)


def make_batch(rows: Rows, idx: list[int], seq: int, feat_idx: list[int]) -> Batch:
    """Right-padded [B, seq] batch of rows `idx` (no positions yet: `Batch.at`); rows longer
    than seq keep their last seq tokens."""
    b = len(idx)
    d = rows.feats[0].shape[-1]
    tokens, lens = np.zeros((b, seq), np.int32), np.zeros((b,), np.int32)
    plens = np.zeros((b,), np.int32)
    feats = np.zeros((b, seq, len(feat_idx), d), np.float16)
    final = np.zeros((b, seq, d), np.float16)
    for i, r in enumerate(idx):
        t, f, p = rows.tokens[r], rows.feats[r], rows.plens[r]
        off, p = window(len(t), p, seq)
        t, f = t[off:], f[off:]
        n = len(t)
        tokens[i, :n] = t
        feats[i, :n] = f[:, feat_idx]
        final[i, :n] = f[:, -1]
        lens[i], plens[i] = n, p
    return Batch(tokens=tokens, lens=lens, plens=plens, feats=feats, final=final)


def batches_for(rows: Rows, seq_buckets: tuple[int, ...], tokens_per_batch: int
                ) -> list[tuple[int, list[int]]]:
    """A fixed list of (bucket, row indices); rows grouped by length bucket."""
    by: dict[int, list[int]] = {s: [] for s in seq_buckets}
    for i, t in enumerate(rows.tokens):
        s = next((s for s in seq_buckets if len(t) <= s), seq_buckets[-1])
        by[s].append(i)
    out = []
    for s, ids in by.items():
        bsz = max(1, tokens_per_batch // s)
        for j in range(0, len(ids) - bsz + 1, bsz):
            out.append((s, ids[j: j + bsz]))
        if len(ids) % bsz and len(ids) >= bsz:
            out.append((s, ids[-bsz:]))  # the remainder, completed with earlier rows
    return out


def sample_positions(rng: np.random.Generator, lens: np.ndarray, plens: np.ndarray, n: int,
                     lo_off: int, hi_off: int) -> tuple[np.ndarray, np.ndarray]:
    """n positions per row in [plen + lo_off, len - hi_off] (with replacement if few); valid mask."""
    b = len(lens)
    pos = np.zeros((b, n), np.int32)
    valid = np.zeros((b, n), bool)
    for i in range(b):
        lo, hi = int(plens[i]) + lo_off, int(lens[i]) - hi_off
        if hi < lo:
            continue
        cand = np.arange(lo, hi + 1)
        if len(cand) >= n:
            pos[i] = np.sort(rng.choice(cand, n, replace=False))
            valid[i] = True
        else:
            pos[i, : len(cand)] = cand
            valid[i, : len(cand)] = True
    return pos, valid


@dataclasses.dataclass
class TrainingData:
    """A run's data, set up once the same way for every trainer (`training_data`)."""

    rows: Rows  # the training rows (only the drafter's feature columns, then the final-normed)
    held: Rows  # the held-out rows (empty when the directory has none)
    feat_idx: list[int]  # the drafter's columns in `rows.feats`
    plan: list[tuple[int, list[int]]]  # the training batches (`batches_for`)
    held_plan: list[tuple[int, list[int]]]  # the first `--eval-batches` held-out batches


def training_data(args: Any, feature_layers: tuple[int, ...], say: Callable[..., Any] = print,
                  train: bool = True) -> TrainingData:
    """The rows, held-out rows and batch plans of `args.data` for a drafter reading
    `feature_layers` (`args`: data, sets, seq_buckets, batch_tokens, eval_batches, eval_every).

    Only the drafter's feature columns are kept in memory. Without held-out shards a warning is
    said and `args.eval_every` set to 0 (no held-out evaluation). `train=False`: the held-out
    rows only (they must exist), every one of their batches planned.
    """
    recorded = data_layers(args.data)
    missing = set(feature_layers) - set(recorded)
    if missing:
        raise SystemExit(f"error: {args.data} lacks feature layers {sorted(missing)}")
    cols = [recorded.index(i) for i in feature_layers]
    feat_idx = list(range(len(cols)))  # rows hold only these columns (then the final-normed)
    sets = getattr(args, "sets", None)
    buckets = tuple(args.seq_buckets)
    if not train:
        held = load_rows(args.data, heldout=True, sets=sets, layers=cols)
        return TrainingData(Rows([], [], []), held, feat_idx, [],
                            batches_for(held, buckets, args.batch_tokens))
    rows = load_rows(args.data, heldout=False, sets=sets, layers=cols)
    try:
        held = load_rows(args.data, heldout=True, sets=sets, layers=cols)
    except SystemExit:
        say("warning: no held-out shards (`python -m train datagen --split heldout`): "
            "no held-out evaluation", flush=True)
        held = Rows([], [], [])
        args.eval_every = 0
    plan = batches_for(rows, buckets, args.batch_tokens)
    held_plan = (batches_for(held, buckets, args.batch_tokens)[: args.eval_batches]
                 if len(held) else [])
    return TrainingData(rows, held, feat_idx, plan, held_plan)
