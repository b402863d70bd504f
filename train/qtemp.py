"""`python -m train qtemp`: fit a trained drafter's q temperature on the held-out shards.

At T > 0 a drafter samples from q = softmax(z / (T * s)) over its draft vocabulary, and lossless
speculative sampling accepts position k with probability alpha_k = sum_v min(p(v), q(v)), p the
target's distribution at T over the whole vocabulary. A drafter trained with cross-entropy is
broader than p where it is unsure, so a scale s < 1 can raise alpha; any q is verified exactly,
so s changes how much is accepted, never what is sampled (`DrafterConfig.q_temperature`).

For every chain start (EAGLE-3) or anchor (DFlash) of the held-out batches — the training
recipe's positions and its training-time-test forward — alpha_k is computed for each candidate
s; the objective is the chain estimate 1 + sum_k prod_{j<=k} alpha_j (the forward conditions on
the target's own tokens, so it ranks scales; it is not a measured tau). `--out PATH` writes the
drafter with the best s (the tensors copied bit for bit; PATH may be the input file).

Fit on held-out text sampled at the temperature fitted, not on greedy answers: on greedy text
p is peaked where the drafter is broad, and the fit sharpens too much (the shipped EAGLE-3: best
s 0.65 on the greedy held-out shards, 0.9 on held-out T = 1 samples; docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jspec import safetensors_io
from jspec.drafters.loading import drafter_file
from jspec.drafters.trained import (
    DrafterConfig,
    Frozen,
    Params,
    check_target,
    load_drafter_file,
    split_frozen,
)
from jspec.errors import JspecError
from jspec.models.model import load_model
from train import drafter_cli
from train.batches import positions, to_device
from train.data import Batch, make_batch, training_data
from train.losses import forward_blocks
from train.recipes import RECIPES


def acceptance(kind: str, cfg: DrafterConfig, params: Params, frozen: Frozen,
               batch: Batch, temperature: float, scales: tuple[float, ...]
               ) -> tuple[jax.Array, jax.Array]:
    """(alpha f32[S, N, K] for each scale, valid bool[N, K]) over a batch's N blocks of K
    positions: alpha = sum_v min(p(v), q_s(v)), p = softmax(target logits / T) over the whole
    vocabulary (its tied head `frozen.embed`), q_s = softmax(drafter logits / (T s)) over the
    draft vocabulary."""
    logits, t_logits, _, valid, _, fh = forward_blocks(kind, cfg, params, frozen, batch,
                                                          with_target_hidden=True)
    n, kk = valid.shape
    # The target's full-vocabulary normaliser (t_logits holds only the draft vocabulary's).
    lse = jax.lax.map(lambda h: jax.nn.logsumexp(frozen.embed @ h / temperature),
                      fh.reshape(n * kk, -1), batch_size=256).reshape(n, kk)
    p = jnp.exp(t_logits / temperature - lse[..., None])  # [N, K, Vd]: p on the draft vocab
    alpha = jnp.stack([jnp.sum(jnp.minimum(p, jax.nn.softmax(logits / (temperature * s), -1)),
                               axis=-1) for s in scales])
    return alpha, valid


def chain_estimate(alpha: np.ndarray) -> np.ndarray:
    """f[..., N] = 1 + sum_k prod_{j<=k} alpha[..., N, j]."""
    return 1.0 + np.cumprod(alpha, axis=-1).sum(axis=-1)


def write_q_temperature(src: Path, dst: Path, q_temperature: float) -> None:
    """`src` with `q_temperature` in its config, every tensor and other metadata entry as is."""
    meta = safetensors_io.read_metadata(src)
    tensors = {k: np.array(v) for k, v in safetensors_io.read(src).items()}  # src may be dst
    cfg = json.loads(meta["jspec_drafter"])
    cfg["q_temperature"] = float(q_temperature)
    meta["jspec_drafter"] = json.dumps(cfg)
    DrafterConfig.from_json(meta["jspec_drafter"])  # still a valid config
    safetensors_io.write(dst, tensors, meta)


def run(args: argparse.Namespace) -> int:
    scales = tuple(sorted({float(x) for x in args.scales.split(",")}))
    if not scales or min(scales) <= 0:
        raise SystemExit(f"error: --scales must be positive numbers, got {args.scales!r}")
    if not args.temperature > 0:
        raise SystemExit(f"error: --temperature must be > 0, got {args.temperature}")
    target = load_model(args.model)
    try:
        cfg, params0, vocab = load_drafter_file(drafter_file(args.drafter))
        check_target(cfg, target.config)
    except JspecError as e:
        raise SystemExit(f"error: {e}") from e
    if cfg.kind not in RECIPES:
        raise SystemExit(f"error: {args.drafter} is a {cfg.kind} drafter; qtemp fits "
                         f"{' / '.join(RECIPES)} drafters")
    # The recipe's own arguments (positions per row, window) at their training defaults.
    sub = argparse.ArgumentParser().add_subparsers()
    drafter_cli.add_parsers(sub)
    rargs = sub.choices[cfg.kind].parse_args(["--seed", str(args.seed), "--data", args.data])
    data = training_data(rargs, cfg.feature_layers, train=False)
    held, plan = data.held, data.held_plan[: args.batches]
    params, stats = split_frozen(params0)
    frozen = Frozen.of(target.weights.embed, vocab, stats)
    step = jax.jit(lambda b: acceptance(cfg.kind, cfg, params, frozen, b, args.temperature,
                                        scales))
    feat_idx = data.feat_idx
    alpha_sum, chain_sum, blocks = 0.0, np.zeros(len(scales)), 0
    bar = tqdm(plan, desc="qtemp", unit="batch")
    for j, (seq, idx) in enumerate(bar):
        b = make_batch(held, idx, seq, feat_idx)
        rng = np.random.default_rng([args.seed, 10**6 + j])  # the training run's eval blocks
        b = b.at(*positions(rargs, cfg.kind, rng, b.lens, b.plens))
        alpha, valid = step(to_device(None, b))
        full = np.asarray(valid).all(axis=1)  # blocks whose every position is in the row
        alpha = np.asarray(alpha)[:, full]
        alpha_sum = alpha_sum + alpha.sum(axis=1)
        chain_sum += chain_estimate(alpha).sum(axis=1)
        blocks += int(full.sum())
        bar.set_postfix(blocks=blocks)
    bar.close()
    if blocks == 0:
        raise SystemExit(f"error: no complete held-out blocks in {args.data}")
    est = chain_sum / blocks
    best = scales[int(np.argmax(est))]
    print(f"{args.drafter} ({cfg.kind}, stored q_temperature {cfg.q_temperature:g}): "
          f"{blocks} held-out blocks of {len(held)} sequences, T = {args.temperature:g}")
    print("| s | alpha by position | chain estimate |")
    print("|---|---|---|")
    for i, s in enumerate(scales):
        al = " ".join(f"{x:.3f}" for x in alpha_sum[i] / blocks)
        mark = " (best)" if s == best else ""
        print(f"| {s:g}{mark} | {al} | {est[i]:.3f} |")
    if args.out:
        write_q_temperature(drafter_file(args.drafter), Path(args.out), best)
        print(f"wrote {args.out} with q_temperature {best:g}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("qtemp", help="fit a trained drafter's q temperature on held-out data",
                       description=__doc__.split("\n\n")[0] + " " + __doc__.split("\n\n")[1])
    p.add_argument("--drafter", required=True,
                   help="EAGLE-3 or DFlash drafter: a file or a shipped name")
    p.add_argument("--data", default="runs/data",
                   help="datagen / featurize shard directory; its heldout_* shards are used: "
                        "text sampled at --temperature, which the drafter was not trained on "
                        "(greedy text overstates the sharpening)")
    p.add_argument("--model", default="smollm2-135m", help="target model")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature to fit at (default 1)")
    p.add_argument("--scales", default="0.4,0.5,0.6,0.7,0.8,0.9,1",
                   help="candidate q temperatures s, comma-separated")
    p.add_argument("--batches", type=int, default=8, help="held-out batches to use")
    p.add_argument("--seed", type=int, default=0, help="seed of the block positions")
    p.add_argument("--out", default="",
                   help="write the drafter with the best s here (may be --drafter itself)")
    p.set_defaults(func=run)
