"""`python -m train featurize`: the feature shards training reads, from token shards.

Decoding is what makes data generation slow (one target forward per generated token); the
features of a finished sequence are one batched forward over it, 3-6x cheaper per token
here. So `datagen --tokens-only` writes compact token shards (small enough to commit: a session's
generated data survives it) and this command adds the features: the layout of `train.datagen`
(feats f16[T_total, F, D], the RMS-normalised FEATURE_LAYERS then the final-normed state, the
last token of each row zero because it is never fed). One forward over the whole sequence gives
the same hidden states as the decode that produced it, up to float rounding (tested).
Resumable: a feature shard that exists is skipped.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jspec.models.blocks import rms_normalize
from jspec.models.cache import KVCache
from jspec.models.config import ModelConfig
from jspec.models.llama import Weights, forward
from jspec.models.model import load_model
from train.datagen import FEATURE_LAYERS, Shard, load_shard, save_shard


@functools.partial(jax.jit, static_argnames=("config", "layers"))
def features_of(weights: Weights, ids: jax.Array, *, config: ModelConfig,
                layers: tuple[int, ...]) -> jax.Array:
    """f16[B, W, F, D] features of every position of i32[B, W] (causal: padding after a row's
    end does not touch its positions)."""
    b, w = ids.shape
    pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    out = forward(config, weights, ids, pos, KVCache.create(config, b, w), hidden_layers=layers,
                  compute_logits=False)
    f = jnp.concatenate([rms_normalize(out.hidden), out.final_hidden[None]], axis=0)
    return jnp.moveaxis(f, 0, 2).astype(jnp.float16)


def width_of(n: int) -> int:
    """Forward widths: multiples of 64 (a handful of compiles for a whole corpus)."""
    return -(-n // 64) * 64


def featurize_shard(model: Any, shard: Shard, layers: tuple[int, ...],
                    tokens_per_call: int = 8192) -> Shard:
    """`shard` with its features: rows sorted by length, grouped into forwards of at most
    `tokens_per_call` tokens; the row count of a forward is a power of two (few compiles, at
    most half of a forward's rows padding)."""
    offs = shard.offsets
    lens = np.diff(offs).astype(np.int64)
    f_dim, d = len(layers) + 1, model.config.hidden_size
    feats = np.zeros((int(offs[-1]), f_dim, d), np.float16)
    order = np.argsort(lens, kind="stable")
    i = 0
    while i < len(order):
        w = width_of(int(lens[order[i]]))
        cap = max(1, tokens_per_call // w)
        group = [r for r in order[i:i + cap] if lens[r] <= w]
        rows = min(1 << (len(group) - 1).bit_length(), cap)
        ids = np.zeros((rows, w), np.int32)
        for j, r in enumerate(group):
            ids[j, : lens[r]] = shard.tokens[offs[r]:offs[r + 1]]
        f = np.asarray(features_of(model.weights, jnp.asarray(ids), config=model.config,
                                   layers=layers))
        for j, r in enumerate(group):  # the last token of a row is never fed: zeros
            feats[offs[r]:offs[r + 1] - 1] = f[j, : lens[r] - 1]
        i += len(group)
    return Shard(tokens=shard.tokens, offsets=shard.offsets, prompt_lens=shard.prompt_lens,
                 feats=feats)


def run(args: argparse.Namespace) -> int:
    src, out = Path(args.tokens), Path(args.out)
    files = sorted(f for f in src.glob("*.npz") if not f.name.endswith(".tmp.npz"))
    if not files:
        raise SystemExit(f"error: no token shards (*.npz) in {src}")
    meta_in = json.loads((src / "meta.json").read_text()) if (src / "meta.json").exists() else {}
    model = load_model(args.model or meta_in.get("model", "smollm2-135m"))
    layers = tuple(args.feature_layers) if args.feature_layers else FEATURE_LAYERS
    if max(layers) > model.config.num_layers:
        raise SystemExit(f"error: feature layer {max(layers)} > the model's "
                         f"{model.config.num_layers} layers")
    out.mkdir(parents=True, exist_ok=True)
    meta = {**meta_in, "feature_layers": list(layers), "tokens_only": False,
            "hidden_size": model.config.hidden_size, "featurized_from": str(src)}
    meta_path = out / "meta.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old.get("feature_layers") != list(layers) or old.get("model") != meta.get("model"):
            raise SystemExit(f"error: {out} holds data made with other settings; use another "
                             "--out")
    meta_path.write_text(json.dumps(meta, indent=1))
    todo = [f for f in files if not (out / f.name).exists()]
    print(f"featurize: {len(files)} token shards, {len(files) - len(todo)} already done -> "
          f"{out}", flush=True)
    bar = tqdm(todo, unit="shard", dynamic_ncols=True)
    n_tok, t0 = 0, time.perf_counter()
    for f in bar:
        sh = load_shard(f)
        if sh.feats is not None:
            raise SystemExit(f"error: {f} already holds features (not a token shard)")
        save_shard(out / f.name, featurize_shard(model, sh, layers, args.tokens_per_call))
        n_tok += len(sh.tokens)
        bar.set_postfix(tok_s=f"{n_tok / (time.perf_counter() - t0):.0f}")
    print(f"featurize: done, {n_tok} tokens this run", flush=True)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("featurize", help="feature shards (what training reads) from token "
                       "shards written by `datagen --tokens-only`; resumable")
    p.add_argument("--tokens", required=True, help="directory of token shards")
    p.add_argument("--out", default="runs/data", help="feature shard directory (default "
                   "runs/data)")
    p.add_argument("--model", default=None, help="target model (default: the one the token "
                   "shards' meta.json names)")
    p.add_argument("--feature-layers", type=int, nargs="+", default=None,
                   help=f"target layers to record (default {list(FEATURE_LAYERS)})")
    p.add_argument("--tokens-per-call", type=int, default=8192,
                   help="tokens in one batched forward (default 8192)")
    p.set_defaults(func=run)
