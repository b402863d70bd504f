"""`python -m train eagle3 | dflash`: train a drafter on the target's own responses.

Data: shards from `python -m train datagen` (tokens + cached target features). The loss is
soft CE (against the target's distribution restricted to the draft vocabulary, recomputed from
the cached final hidden state through the shared LM head) + hard CE (the target's token), with
position weights 0.8^(k-1) (EAGLE-3) or exp(-(k-1)/7) (DFlash). `--vat` adds verification-aware
training (ALGORITHMS.md §6): a simulated greedy verification of every drafted block gives k*, the
first rejected position; the verification head learns 1[k < k*] (BCE, gradient into the drafter)
and the position weights become 1 before k* and the base decay restarted at k*.

Infrastructure: Optax AdamW with warmup + cosine decay and global-norm clipping; Orbax
checkpoints every --ckpt-every steps and at the end; a rerun of the same command resumes from the
last checkpoint (batches and anchors are functions of (seed, step), so a resumed run is the run
that would have happened). Progress bar with loss and simulated acceptance; periodic held-out
evaluation: simulated τ at sampled positions and `tau_replay`, the τ greedy decoding gets along
the held-out greedy answers (`replay_rounds`). The result is a safetensors drafter file
(bfloat16) that `jspec.load_drafter` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec import launch, sharding
from jspec.drafters import kinds
from jspec.drafters.loading import drafter_file
from jspec.drafters.trained import (
    DrafterConfig,
    Eagle3Params,
    Frozen,
    Params,
    check_target,
    init_dense,
    load_drafter_file,
    save_drafter,
    split_frozen,
    with_stats,
)
from jspec.errors import JspecError
from jspec.models.model import load_model
from train.batches import batch_for_step, batch_sharding, plan_entry, positions, step_batch
from train.data import (
    Rows,
    batches_for,
    coverage,
    data_layers,
    draft_vocab,
    feature_stats,
    sample_positions,
    training_data,
)
from train.evaluation import drafts_along, evaluate, greedy_drafts, replay_batch, replay_rounds
from train.loop import Loop, finish_checkpoints, optimizer, plot_log, run_loop
from train.losses import block_loss, forward_blocks
from train.recipes import DEFAULT_DRAFT_VOCAB, RECIPES, Recipe, base_weight
from train.update import eval_step, shard_for_training, train_step

# The names tests, scripts and the other trainers import from here (`train.drafters` was one
# module before losses, batches, evaluation and the CLI moved out).
__all__ = [
    "DEFAULT_DRAFT_VOCAB", "RECIPES", "Recipe", "Rows", "base_weight", "batch_for_step",
    "batch_sharding", "batches_for", "block_loss", "drafter_config", "drafts_along",
    "eval_step", "evaluate", "finish_checkpoints", "forward_blocks", "greedy_drafts",
    "grow_ffn", "init_from", "optimizer", "plan_entry", "plot_log", "positions",
    "replay_batch", "replay_rounds", "run", "sample_positions", "shard_for_training",
    "step_batch", "train_step",
]


def drafter_config(args: argparse.Namespace, target_config: Any,
                   recorded: tuple[int, ...]) -> DrafterConfig:
    c = target_config
    return DrafterConfig(
        kind=args.kind, hidden_size=c.hidden_size, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        ffn_size=args.ffn or RECIPES[args.kind].ffn,
        draft_vocab=args.draft_vocab or DEFAULT_DRAFT_VOCAB, target_vocab=c.vocab_size,
        rope_theta=c.rope_theta,
        rms_eps=c.rms_eps, target=args.model, vat=bool(args.vat or args.vat_head),
        **RECIPES[args.kind].shape(args, recorded))


def init_from(args: argparse.Namespace, target_config: Any
              ) -> tuple[DrafterConfig, Params, np.ndarray]:
    """(config, parameters, vocabulary) of the `--init` drafter a run continues from: its shape,
    vocabulary and feature statistics are kept (of the shape flags only a larger --draft-vocab
    or --ffn is used: it grows the drafter, see `grow_ffn`); the optimizer and the
    learning-rate schedule start afresh."""

    try:
        cfg, params, vocab = load_drafter_file(drafter_file(args.init))
        check_target(cfg, target_config)
    except JspecError as e:
        raise SystemExit(f"error: --init: {e}") from e
    if cfg.kind != args.kind:
        raise SystemExit(f"error: --init {args.init} is a {cfg.kind} drafter, not {args.kind}")
    if cfg.vat != bool(args.vat_head):
        raise SystemExit(f"error: --init {args.init} was trained "
                         f"{'with' if cfg.vat else 'without'} the VAT head: "
                         f"{'pass' if cfg.vat else 'drop'} --vat / --vat-head")
    return cfg, params, vocab


def grow_ffn(cfg: DrafterConfig, params: Params, ffn: int, key: jax.Array
             ) -> tuple[DrafterConfig, Params]:
    """The drafter with every layer's MLP widened from cfg.ffn_size to `ffn` units, computing
    the same function: the new units' gate and up columns are drawn as a fresh layer's, their
    down-projection rows are zero (so they add nothing until trained, and their gradient is
    not zero). `ffn` == cfg.ffn_size returns the drafter as it is."""

    old = cfg.ffn_size
    if ffn < old:
        raise SystemExit(f"error: --ffn {ffn} is narrower than the {old} units of the --init "
                         "drafter: it can only grow")
    if ffn == old:
        return cfg, params
    d = cfg.hidden_size

    def widen(layer: Any, k: jax.Array) -> Any:  # w_gate/w_up [D, F], w_down [F, D]
        kg, ku = jax.random.split(k)
        return dataclasses.replace(
            layer,
            w_gate=jnp.concatenate([jnp.asarray(layer.w_gate, jnp.float32),
                                    init_dense(kg, d, ffn - old)], axis=1),
            w_up=jnp.concatenate([jnp.asarray(layer.w_up, jnp.float32),
                                  init_dense(ku, d, ffn - old)], axis=1),
            w_down=jnp.concatenate([jnp.asarray(layer.w_down, jnp.float32),
                                    jnp.zeros((ffn - old, d), jnp.float32)], axis=0))

    if isinstance(params, Eagle3Params):
        params = dataclasses.replace(params, layer=widen(params.layer, key))
    else:
        keys = jax.random.split(key, len(params.layers))
        params = dataclasses.replace(params, layers=tuple(
            widen(lay, k) for lay, k in zip(params.layers, keys, strict=True)))
    return dataclasses.replace(cfg, ffn_size=ffn), params


def run(args: argparse.Namespace) -> int:
    """`python -m train eagle3 | dflash` (flags: `train.drafter_cli`)."""
    if args.vat:
        args.vat_head = args.vat_weight = True
    # One process per host: under `python -m jspec.launch` the rendezvous is in the environment;
    # --distributed also lets jax.distributed find it on a cluster (Cloud TPU, SLURM).
    launch.initialize(fallback=args.distributed)
    try:
        mesh = sharding.parse_mesh(args.mesh) if args.mesh else None
    except JspecError as e:
        raise SystemExit(f"error: {e}") from e
    writer = jax.process_index() == 0  # multi-host: one process writes the log and the file
    say = print if writer else (lambda *a, **k: None)  # the others print nothing either
    out = Path(args.out).resolve()
    if writer:  # the others write nothing but their own checkpoint shards (Orbax makes ckpt/)
        out.mkdir(parents=True, exist_ok=True)
    target = load_model(args.model)
    recorded = data_layers(args.data)
    init = init_from(args, target.config) if args.init else None
    cfg = init[0] if init else drafter_config(args, target.config, recorded)
    data = training_data(args, cfg.feature_layers, say)
    rows, held, feat_idx = data.rows, data.held, data.feat_idx
    vocab_path = out / "vocab.npy"
    if init is not None:  # the init drafter's vocabulary (its head rows are these tokens)
        vocab = init[2]
        if args.draft_vocab is not None and args.draft_vocab != len(vocab):
            if args.draft_vocab < len(vocab):
                raise SystemExit(f"error: --draft-vocab {args.draft_vocab} is smaller than the "
                                 f"{len(vocab)} tokens of --init {args.init}: it can only grow")
            vocab = draft_vocab(rows, args.draft_vocab, target.eos_ids, keep=vocab)
            cfg = dataclasses.replace(cfg, draft_vocab=len(vocab))
        if vocab_path.exists() and not np.array_equal(np.load(vocab_path), vocab):
            raise SystemExit(f"error: {vocab_path} is not the vocabulary of --init {args.init} "
                             "(a run directory from another start: use a new --out)")
        if writer and not vocab_path.exists():
            tmp = out / f".vocab-{os.getpid()}.npy"
            np.save(tmp, vocab)
            os.replace(tmp, vocab_path)
    elif vocab_path.exists():
        vocab = np.load(vocab_path)
    else:  # every process computes the same vocabulary; process 0 writes it, atomically
        vocab = draft_vocab(rows, args.draft_vocab or DEFAULT_DRAFT_VOCAB, target.eos_ids)
        if writer:
            tmp = out / f".vocab-{os.getpid()}.npy"
            np.save(tmp, vocab)
            os.replace(tmp, vocab_path)
    plan, held_plan = data.plan, data.held_plan
    resp = sum(len(t) - p for t, p in zip(rows.tokens, rows.plens, strict=True))
    say(f"train {cfg.kind}: {len(rows)} sequences ({resp} response tokens), {len(plan)} "
          f"batches/epoch; held-out {len(held)} sequences; draft vocab {len(vocab)} covers "
          f"{coverage(rows, vocab):.1%} of training / {coverage(held, vocab):.1%} of held-out "
          "response tokens", flush=True)

    if init is not None:  # its parameters and the feature statistics it was trained with
        params, stats = split_frozen(init[1])
        cfg, params = grow_ffn(cfg, params, args.ffn or cfg.ffn_size,
                               jax.random.key(args.seed))
    else:
        stats = feature_stats(rows, feat_idx, args.seed)
        params, _ = split_frozen(kinds.get(cfg.kind).init_params(cfg, jax.random.key(args.seed)))
        # The LM head is the target's: start from a fifth of the target's final norm, so that
        # the first logits are near-uniform in the target's geometry (the target's full scale on
        # random hidden states starts at ~20 nats of cross-entropy instead of ~8).
        params = dataclasses.replace(
            params, final_norm=0.2 * jnp.asarray(target.weights.final_norm, jnp.float32))
    frozen = Frozen.of(target.weights.embed, vocab, stats)
    tx = optimizer(args)
    opt_state = tx.init(params)
    if mesh is not None:  # before a restore, which then fills the placed layout
        params, opt_state, frozen = shard_for_training(mesh, cfg, params, opt_state, frozen)
        say(f"mesh {dict(mesh.shape)}: batch rows over data, heads / MLP / vocabulary over "
              "model", flush=True)
    statics = dict(kind=cfg.kind, cfg=cfg, tx=tx, vat_head=args.vat_head,
                   matmul_dtype=args.matmul_dtype,
                   vat_weight=args.vat_weight, mesh=mesh)

    def step_fn(params, opt_state, step):
        batch = step_batch(args, rows, plan, step, feat_idx, cfg, mesh)
        return train_step(params, opt_state, frozen, batch, **statics)

    loop = Loop(step=step_fn, shown=("loss", "acc1", "tau_sim"), eval_at_start=init is not None,
                evaluate=lambda p: evaluate(args, held, held_plan, feat_idx, cfg, p, frozen,
                                            mesh))
    # --stop-after: end at that step with a checkpoint (the schedule is still the --steps run's).
    params, opt_state, end = run_loop(loop, params, opt_state, out, steps=args.steps,
                                      ckpt_every=args.ckpt_every, eval_every=args.eval_every,
                                      stop_after=args.stop_after, writer=writer, say=say)
    if end < args.steps:
        return 0
    final = out / f"{args.name or cfg.kind}.safetensors"
    if jax.process_count() > 1:  # shards on other hosts: gather the full arrays everywhere
        params = sharding.to_host(params)
    if not writer:
        return 0
    save_drafter(final, cfg, with_stats(params, stats), vocab, dtype="float32" if args.f32 else "bfloat16")
    size = final.stat().st_size / 2**20
    print(f"wrote {final} ({size:.1f} MiB) after {args.steps} steps", flush=True)
    return 0


