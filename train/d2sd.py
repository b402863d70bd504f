"""`python -m train d2sd`: the variable-prefix second drafter of D²SD (ALGORITHMS.md §5).

A fine-tune of a DFlash drafter (default: the shipped smollm2-135m-dflash, whose parameters,
draft vocabulary and feature statistics it starts from). Each sampled block gets a prefix
length l with P(l = j) ∝ β^j, j = 0..γ-2; the block input is [anchor, t*_1..t*_l known,
MASK..] (`jspec.drafters.d2sd.block_inputs_prefix`) and the loss is
  -Σ_{k>l} w_k log p_k(t*_k) / Σ w_k,   w_k = exp(-(k-l-1)/τ),
over all blocks of the batch (t* = the target's token; tokens outside the draft vocabulary are
skipped). Defaults β = 0.9, τ = 7, γ = the first drafter's block.

Not simulated in training: at inference the branch's first slot excludes the first drafter's
token (a second drafter forward per step would double the cost).

Infrastructure as `python -m train dflash`: Optax AdamW with warmup + cosine decay and
global-norm clipping; Orbax checkpoints and resume (batches, anchors and prefix lengths are
functions of (seed, step)); progress bar; held-out evaluation (also at step 0: the first
drafter itself as a variable-prefix drafter). The result is a drafter file of kind "d2sd" whose
metadata names the first drafter; `jspec.load_drafter` builds the tree drafter from both.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec.drafters import d2sd, kinds
from jspec.drafters.loading import SHIPPED, drafter_file
from jspec.drafters.trained import (
    DrafterConfig,
    Frozen,
    Params,
    draft_logits,
    load_drafter_file,
    save_drafter,
    split_frozen,
    with_stats,
)
from jspec.models.model import load_model
from train.batches import plan_entry, to_device
from train.data import (
    Batch,
    Rows,
    coverage,
    make_batch,
    sample_positions,
    training_data,
)
from train.loop import Loop, optimizer, run_loop


def resolve_init(init: str) -> tuple[Path, str]:
    """(file, reference stored in the output) for --init: a shipped name or a file."""
    if init in SHIPPED:
        return drafter_file(init), init
    path = drafter_file(init).resolve()
    if not path.is_file():
        raise SystemExit(f"error: --init {init}: not a shipped drafter name nor a file")
    return path, str(path)


def prefix_lengths(rng: np.random.Generator, shape: tuple[int, ...], gamma: int,
                   beta: float) -> np.ndarray:
    """i32[shape]: l with P(l = j) ∝ β^j, j = 0..γ-2."""
    p = beta ** np.arange(gamma - 1, dtype=np.float64)
    return rng.choice(gamma - 1, size=shape, p=p / p.sum()).astype(np.int32)


def block_loss(logits: jax.Array, hard: jax.Array, valid: jax.Array, prefix: jax.Array,
               tau: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The variable-prefix loss and simulated-greedy metrics.

    Args (N blocks, K = γ-1 slots, Vd draft vocabulary):
      logits f32[N, K, Vd]: slot j+1's prediction at [:, j]; hard i32[N, K] the target token
      as a draft index (-1: outside it); valid bool[N, K]; prefix i32[N] known slots l.
    """
    kk = logits.shape[1]
    slot = jnp.arange(1, kk + 1)[None]  # [1, K]
    after = slot > prefix[:, None]
    logq = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logq, jnp.maximum(hard, 0)[..., None], axis=-1)[..., 0]
    w = jnp.where(after, jnp.exp(-(slot - prefix[:, None] - 1) / tau), 0.0)
    w = w * (valid & (hard >= 0))
    loss = jnp.sum(w * nll) / jnp.maximum(jnp.sum(w), 1e-6)
    # Simulated greedy verification of the re-drafted part: matches from slot l+1 on.
    match = (jnp.argmax(logits, -1) == hard) & valid
    run = jnp.cumprod(jnp.where(after, match, True).astype(jnp.int32), axis=1) * after
    accepted = jnp.sum(run, axis=1)
    first = jnp.take_along_axis(valid & after, jnp.minimum(prefix, kk - 1)[:, None], axis=1)[:, 0]
    first = first & (prefix < kk)
    n = jnp.maximum(jnp.sum(first), 1)
    hit1 = jnp.take_along_axis(match, jnp.minimum(prefix, kk - 1)[:, None], axis=1)[:, 0]
    return loss, {"loss": loss, "acc_first": jnp.sum(hit1 & first) / n,
                  "tau_sim": 1.0 + jnp.sum(jnp.where(first, accepted, 0)) / n}


def forward_blocks(cfg: DrafterConfig, params: Params, frozen: Frozen,
                   batch: Batch) -> tuple[jax.Array, ...]:
    """(logits, hard, valid, prefix) flattened over the batch's blocks (`batch` with anchors
    and prefix lengths: `_blocks`)."""
    tokens, lens = batch.tokens, batch.lens
    feats = batch.feats.astype(jnp.float32)
    params = with_stats(params, frozen.stats)
    s = tokens.shape[1]
    gamma = cfg.block
    anchors, prefix = batch.pos, batch.prefix
    h = d2sd.train_forward(cfg, params, frozen.embed, tokens, feats, anchors, prefix, gamma)
    hsel = h[:, :, 1:]
    tpos = anchors[..., None] + jnp.arange(1, gamma)[None, None]
    valid = batch.valid[..., None] & (tpos < lens[:, None, None])
    b, n, kk = tpos.shape
    tpc = jnp.minimum(tpos, s - 1).reshape(b, n * kk)
    hard = frozen.to_draft[jnp.take_along_axis(tokens, tpc, axis=1)].reshape(b, n, kk)
    logits = draft_logits(cfg, params, frozen.head, hsel)
    return (logits.reshape(b * n, kk, -1), hard.reshape(b * n, kk), valid.reshape(b * n, kk),
            prefix.reshape(b * n))


@functools.partial(jax.jit, static_argnames=("cfg", "tx", "tau"),
                   donate_argnames=("params", "opt_state"))
def train_step(params: Params, opt_state: Any, frozen: Frozen, batch: Batch,
               *, cfg: DrafterConfig, tx: Any, tau: float
               ) -> tuple[Params, Any, dict[str, jax.Array]]:

    def loss_fn(p):
        return block_loss(*forward_blocks(cfg, p, frozen, batch), tau=tau)

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics["grad_norm"] = optax.global_norm(grads)
    return params, opt_state, metrics


@functools.partial(jax.jit, static_argnames=("cfg", "tau"))
def eval_step(params: Params, frozen: Frozen, batch: Batch, *,
              cfg: DrafterConfig, tau: float) -> dict[str, jax.Array]:
    return block_loss(*forward_blocks(cfg, params, frozen, batch), tau=tau)[1]


def _blocks(args: argparse.Namespace, rows: Rows, seq: int, idx: list[int], feat_idx: list[int],
            gamma: int, rng: np.random.Generator) -> Batch:
    """Rows `idx` with `--anchors` anchors a row and a prefix length for each."""
    b = make_batch(rows, idx, seq, feat_idx)
    pos, valid = sample_positions(rng, b.lens, b.plens, args.anchors, 0, 2)
    return b.at(pos, valid, prefix_lengths(rng, pos.shape, gamma, args.beta))


def batch_for_step(args: argparse.Namespace, rows: Rows, plan: list, step: int,
                   feat_idx: list[int], gamma: int) -> Batch:
    """Batch `step`: a pure function of (seed, step) (resumable, deterministic; the plan
    visited as `train.batches.plan_entry` visits it)."""
    epoch, i, seq, idx = plan_entry(args, plan, step)
    return _blocks(args, rows, seq, idx, feat_idx, gamma,
                   np.random.default_rng([args.seed, epoch, i, 2]))


def evaluate(args: argparse.Namespace, rows: Rows, plan: list, feat_idx: list[int],
             cfg: DrafterConfig, params: Params, frozen: Frozen) -> dict[str, float]:
    acc: dict[str, list[float]] = {}
    for j, (seq, idx) in enumerate(plan):
        b = _blocks(args, rows, seq, idx, feat_idx, cfg.block,
                    np.random.default_rng([args.seed, 10**6 + j]))
        m = eval_step(params, frozen, to_device(None, b), cfg=cfg, tau=args.tau)
        for k, v in m.items():
            acc.setdefault(k, []).append(float(v))
    return {k: float(np.mean(v)) for k, v in acc.items()}


def run(args: argparse.Namespace) -> int:
    if not 0 < args.beta <= 1 or args.tau <= 0:
        raise SystemExit("error: need 0 < --beta <= 1 and --tau > 0")
    init_path, first_ref = resolve_init(args.init)
    cfg0, params0, vocab = load_drafter_file(init_path)
    if cfg0.kind not in kinds.get("d2sd").starts_from:
        raise SystemExit(f"error: --init must be a DFlash drafter, got kind {cfg0.kind!r}")
    gamma = args.block or cfg0.block
    if not 2 <= gamma <= cfg0.block:
        raise SystemExit(f"error: --block must be in [2, {cfg0.block}] (the first drafter's)")
    cfg = dataclasses.replace(cfg0, kind="d2sd", block=gamma, vat=False)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(args.model)
    data = training_data(args, cfg.feature_layers)
    rows, held, feat_idx = data.rows, data.held, data.feat_idx
    params, stats = split_frozen(params0)
    frozen = Frozen.of(target.weights.embed, vocab, stats)
    plan, held_plan = data.plan, data.held_plan
    print(f"train d2sd (fine-tune of {first_ref}, γ={gamma}, β={args.beta}, τ={args.tau}): "
          f"{len(rows)} sequences, {len(plan)} batches/epoch; held-out {len(held)} sequences; "
          f"draft vocab covers {coverage(rows, vocab):.1%} of training response tokens",
          flush=True)
    tx = optimizer(args)
    opt_state = tx.init(params)

    def step_fn(params, opt_state, step):
        batch = batch_for_step(args, rows, plan, step, feat_idx, gamma)
        return train_step(params, opt_state, frozen, to_device(None, batch), cfg=cfg, tx=tx,
                          tau=args.tau)

    loop = Loop(step=step_fn, shown=("loss", "acc_first", "tau_sim"), eval_at_start=True,
                evaluate=(lambda p: evaluate(args, held, held_plan, feat_idx, cfg, p, frozen))
                if held_plan else None)
    params, _, _ = run_loop(loop, params, opt_state, out, steps=args.steps,
                            ckpt_every=args.ckpt_every, eval_every=args.eval_every)
    final = out / f"{args.name or 'd2sd'}.safetensors"
    save_drafter(final, cfg, with_stats(params, stats), vocab,
                 dtype="float32" if args.f32 else "bfloat16",
                 extra_metadata={d2sd.META_FIRST: first_ref})
    print(f"wrote {final} ({final.stat().st_size / 2**20:.1f} MiB) after {args.steps} steps",
          flush=True)
    return 0


def add_parser(sub: Any) -> None:
    help_ = "train the D²SD variable-prefix second drafter (a fine-tune of a DFlash drafter)"
    p = sub.add_parser("d2sd", help=help_, description=help_ + ".")
    p.set_defaults(func=run)
    p.add_argument("--init", default="smollm2-135m-dflash",
                   help="first drafter (shipped name or .safetensors file): the starting "
                        "parameters, draft vocabulary and feature statistics; its reference is "
                        "stored in the output so that load_drafter can pair the two")
    p.add_argument("--data", default="runs/data", help="datagen shard directory")
    p.add_argument("--out", default="runs/d2sd",
                   help="run directory: checkpoints, log.jsonl, the drafter file")
    p.add_argument("--name", default="", help="drafter file name (default: d2sd)")
    p.add_argument("--model", default="smollm2-135m", help="target model")
    p.add_argument("--sets", nargs="*", default=None,
                   help="prompt sets to train on (default: every set in --data)")
    p.add_argument("--block", type=int, default=0,
                   help="block size γ (default 0: the first drafter's block)")
    p.add_argument("--beta", type=float, default=0.9,
                   help="prefix-length distribution: P(l = j) ∝ beta^j, j = 0..γ-2")
    p.add_argument("--tau", type=float, default=7.0,
                   help="position-weight decay: w_k = exp(-(k-l-1)/tau)")
    p.add_argument("--steps", type=int, default=240, help="optimizer steps")
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (a fine-tune)")
    p.add_argument("--warmup", type=int, default=10, help="linear warmup steps")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--batch-tokens", type=int, default=4096,
                   help="tokens per batch (rows x sequence bucket)")
    p.add_argument("--seq-buckets", type=int, nargs="+", default=[256, 512],
                   help="padded sequence lengths (longer rows keep their last tokens)")
    p.add_argument("--anchors", type=int, default=48,
                   help="anchors (blocks) sampled per sequence per step")
    p.add_argument("--ckpt-every", type=int, default=25, help="Orbax checkpoint interval")
    p.add_argument("--eval-every", type=int, default=80,
                   help="held-out simulated τ every N steps, at step 0 and at the end (0: never)")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches per eval")
    p.add_argument("--seed", type=int, default=0, help="seed of batches, anchors and prefixes")
    p.add_argument("--f32", action="store_true",
                   help="write the drafter in float32 (default bfloat16, half the size)")
