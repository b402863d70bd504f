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
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from jspec import launch, sharding
from jspec.drafters import dflash, eagle3
from jspec.drafters.loading import drafter_file
from jspec.drafters.trained import (
    DrafterConfig,
    Eagle3Params,
    Frozen,
    Params,
    cast_matrices,
    check_target,
    draft_logits,
    init_dense,
    load_drafter_file,
    save_drafter,
    split_frozen,
    verify_head,
    with_stats,
)
from jspec.errors import JspecError
from jspec.models.blocks import dense
from jspec.models.model import load_model
from train.data import (
    Rows,
    batches_for,
    coverage,
    data_layers,
    draft_vocab,
    eagle_layers,
    feature_stats,
    load_rows,
    make_batch,
    sample_positions,
    window,
)
from train.loop import Loop, finish_checkpoints, optimizer, plot_log, run_loop  # noqa: F401


def _eagle3_hidden(cfg: DrafterConfig, p: Params, embed: jax.Array, tokens: jax.Array,
                   feats: jax.Array, start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Training-time test from every position; kept at the sampled chain starts s: hidden
    states f32[B, N, K, D] and the positions i32[B, N, K] they predict (step j: s + j + 1)."""
    steps = cfg.block
    hs = eagle3.train_forward(cfg, p, embed, tokens, feats, steps)
    hsel = jnp.stack([jnp.take_along_axis(h, start[..., None], axis=1) for h in hs], 2)
    return hsel, start[..., None] + jnp.arange(2, steps + 2)[None, None]


def _dflash_hidden(cfg: DrafterConfig, p: Params, embed: jax.Array, tokens: jax.Array,
                   feats: jax.Array, anchors: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Blocks at the sampled anchors a: hidden states f32[B, M, γ-1, D] (block slot k
    predicts token a + k) and those positions i32[B, M, γ-1]."""
    gamma = cfg.block
    h = dflash.train_forward(cfg, p, embed, tokens, feats, anchors, gamma)
    return h[:, :, 1:], anchors[..., None] + jnp.arange(1, gamma)[None, None]


def _eagle3_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="training-time-test steps (unrolled on own predictions)")
    p.add_argument("--positions", type=int, default=128,
                   help="chain starts sampled per sequence per step")


def _dflash_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=2, help="drafter layers")
    p.add_argument("--block", type=int, default=8, help="block size γ (anchor + γ-1)")
    p.add_argument("--anchors", type=int, default=48,
                   help="anchors (blocks) sampled per sequence per step")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What differs between training the trained drafters; the loop, losses, data, eval and
    checkpointing are one code path for all (`RECIPES[kind]`)."""

    init_params: Callable[[DrafterConfig, jax.Array], Params]
    hidden: Callable[..., tuple[jax.Array, jax.Array]]  # (cfg, p, embed, tokens, feats, pos)
    decay: Callable[[jax.Array], jax.Array]  # loss weight by 0-based draft index
    window: tuple[int, int]  # sample_positions' (lo, hi): where positions may sit
    count: str  # the argument giving positions sampled per sequence
    shape: Callable[[argparse.Namespace, tuple[int, ...]], dict[str, Any]]  # config fields
    add_args: Callable[[argparse.ArgumentParser], None]
    ffn: int  # default MLP width
    replay_chunk: int | None = None  # positions per `greedy_drafts` call (None: all at once)


DEFAULT_DRAFT_VOCAB = 4096  # covers 87% of the corpus' response tokens (docs/BENCHMARKS.md)

RECIPES: dict[str, Recipe] = {
    # Chain starts s >= plen - 2 (step 1 predicts s + 2 >= plen); weights 0.8^k.
    "eagle3": Recipe(eagle3.init_params, _eagle3_hidden, lambda k0: 0.8 ** k0, (-2, 3),
                     "positions",
                     lambda a, rec: {"num_layers": 1, "feature_layers": eagle_layers(rec),
                                     "block": a.ttt_steps},
                     _eagle3_args, 1536),
    # Anchors a >= plen (the first generated token) with a + 1 < len; weights exp(-k/7).
    "dflash": Recipe(dflash.init_params, _dflash_hidden, lambda k0: jnp.exp(-k0 / 7.0), (0, 2),
                     "anchors",
                     lambda a, rec: {"num_layers": a.layers, "feature_layers": rec,
                                     "block": a.block},
                     _dflash_args, 1024, replay_chunk=64),  # 64 blocks of γ queries a call
}


def base_weight(kind: str, k0: jax.Array) -> jax.Array:
    """Position weights by 0-based draft index: 0.8^k (EAGLE-3), exp(-k/7) (DFlash)."""
    return RECIPES[kind].decay(k0)


def block_loss(kind: str, logits: jax.Array, t_logits: jax.Array, hard: jax.Array,
               valid: jax.Array, vh: jax.Array, vat_head: bool, vat_weight: bool
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss over drafted blocks.

    Args (N blocks, K draft positions, Vd draft vocabulary):
      logits f32[N, K, Vd] drafter; t_logits f32[N, K, Vd] target (restricted to the draft
      vocabulary); hard i32[N, K] the target's token as a draft index (-1: not in it);
      valid bool[N, K]; vh f32[N, K] verification-head logits.
    """
    kk = logits.shape[1]
    logq = jax.nn.log_softmax(logits, axis=-1)
    pt = jax.nn.softmax(t_logits, axis=-1)
    soft = -jnp.sum(pt * logq, axis=-1)
    hard_ce = -jnp.take_along_axis(logq, jnp.maximum(hard, 0)[..., None], axis=-1)[..., 0]
    hard_ce = jnp.where(hard >= 0, hard_ce, 0.0)
    # Simulated greedy verification: draft argmax == target argmax, up to the first miss.
    match = (jnp.argmax(logits, -1) == jnp.argmax(t_logits, -1)) & valid
    run = jnp.cumprod(match.astype(jnp.int32), axis=1)  # 1 while every earlier one matched
    first_rej = jnp.sum(run, axis=1)  # [N] = k* (0-based index of the first rejection)
    k0 = jnp.arange(kk, dtype=jnp.float32)[None]
    if vat_weight:
        w = jnp.where(k0 < first_rej[:, None], 1.0,
                      base_weight(kind, k0 - first_rej[:, None].astype(jnp.float32)))
    else:
        w = jnp.broadcast_to(base_weight(kind, k0), logits.shape[:2])
    w = jax.lax.stop_gradient(w) * valid
    n_valid = jnp.maximum(jnp.sum(valid), 1)
    ce = jnp.sum(w * (soft + hard_ce)) / n_valid
    label = (k0 < first_rej[:, None]).astype(jnp.float32)
    bce = jnp.sum(valid * (jnp.logaddexp(0.0, vh) - label * vh)) / n_valid
    loss = ce + (bce if vat_head else 0.0)
    blocks = jnp.maximum(jnp.sum(valid[:, 0]), 1)
    # The metrics: decoding never accepts a token outside the draft vocabulary, so a position
    # whose text token is outside it is a miss there, even where the drafter matches the
    # target's best in-vocabulary token (on greedy text, the held-out shards, that token is the
    # target's argmax: this is decoding's greedy acceptance). The loss above keeps `match`.
    hit = match & (hard >= 0)
    hit_run = jnp.sum(jnp.cumprod(hit.astype(jnp.int32), axis=1), axis=1)
    metrics = {"loss": loss, "ce": ce, "vh_bce": bce,
               "acc1": jnp.sum(hit[:, 0]) / blocks,
               "tau_sim": 1.0 + jnp.sum(jnp.where(valid[:, 0], hit_run, 0)) / blocks}
    return loss, metrics


def forward_blocks(kind: str, cfg: DrafterConfig, params: Params, frozen: Frozen,
                   batch: dict[str, jax.Array], matmul_dtype: Any = jnp.float32,
                   with_target_hidden: bool = False) -> tuple[jax.Array, ...]:
    """(logits, target logits, hard, valid, vh) for the sampled blocks of a batch, and with
    `with_target_hidden` the target's final hidden state f32[N, K, D] that gives each position's
    target logits (for a full-vocabulary p: `train.qtemp`).

    matmul_dtype: the operands of the drafter's matmuls and of the draft head (float32
    accumulation either way; the parameters and their gradients stay float32)."""
    tokens, lens = batch["tokens"], batch["lens"]
    feats = batch["feats"].astype(jnp.float32)
    final = batch["final"].astype(jnp.float32)
    head, to_draft = frozen.head.astype(matmul_dtype), frozen.to_draft
    params = cast_matrices(with_stats(params, frozen.stats), matmul_dtype)
    s = tokens.shape[1]
    hsel, tpos = RECIPES[kind].hidden(cfg, params, frozen.embed, tokens, feats, batch["pos"])
    valid = batch["valid"][..., None] & (tpos < lens[:, None, None])
    tpc = jnp.minimum(tpos, s - 1)
    b, n, kk = tpc.shape
    fh = jnp.take_along_axis(final, (tpc - 1).reshape(b, n * kk)[..., None], axis=1)
    t_logits = dense(fh, head.T).reshape(b, n, kk, -1)  # target's logits for token tpos
    hard = to_draft[jnp.take_along_axis(tokens, tpc.reshape(b, n * kk), axis=1)].reshape(b, n, kk)
    logits = draft_logits(cfg, params, head, hsel)
    vh = verify_head(params, hsel)
    flat = lambda x: x.reshape((b * n, kk, *x.shape[3:]))  # noqa: E731
    out = flat(logits), flat(t_logits), flat(hard), flat(valid), flat(vh)
    return (*out, fh.reshape(b * n, kk, -1)) if with_target_hidden else out


def batch_sharding(mesh: Mesh, batch: dict[str, Any]) -> dict[str, NamedSharding]:
    """Rows of every batch array over `data` (the rules table's `batch`), the rest replicated."""
    return sharding.state_sharding(batch, mesh, batch=len(batch["lens"]))


def shard_for_training(mesh: Mesh, cfg: DrafterConfig, params: Params, opt_state: Any,
                       frozen: Frozen, batch: dict[str, Any] | None = None
                       ) -> tuple[Any, ...]:
    """Place the training inputs on `mesh` through the rules table.

    Parameters and optimizer moments: heads / KV heads / MLP over `model` (their fields' axes);
    the frozen target embedding and draft head: vocabulary over `model`; the batch: rows over
    `data`. Multi-host safe (every process holds the same full batch: batches are a function
    of (seed, step)).

    Returns:
      (params, opt_state, frozen[, batch]) placed.
    """
    out = (sharding.place(params, sharding.params_sharding(params, mesh, head_dim=cfg.head_dim)),
           sharding.place(opt_state, sharding.params_sharding(opt_state, mesh,
                                                              head_dim=cfg.head_dim)),
           sharding.place(frozen, sharding.params_sharding(frozen, mesh)))
    if batch is not None:
        out = (*out, sharding.place(batch, batch_sharding(mesh, batch)))
    return out


def _to_device(mesh: Mesh | None, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    if mesh is None:
        return {k: jnp.asarray(v) for k, v in batch.items()}
    return sharding.place(batch, batch_sharding(mesh, batch))


@functools.partial(jax.jit, static_argnames=("kind", "cfg", "tx", "vat_head", "vat_weight", "mesh",
                                             "matmul_dtype"),
                   donate_argnames=("params", "opt_state"))
def train_step(params: Params, opt_state: Any, frozen: Frozen,
               batch: dict[str, jax.Array], *, kind: str, cfg: DrafterConfig, tx: Any,
               vat_head: bool, vat_weight: bool, mesh: Mesh | None = None,
               matmul_dtype: str = "float32") -> tuple[Params, Any, dict[str, jax.Array]]:
    """One optimizer step. `mesh` (static): keep params / moments / batch in their rules-table
    layout (`shard_for_training`); the gradient all-reduce over `data` is the compiler's.
    `matmul_dtype`: "float32" or "bfloat16" operands in the forward and backward matmuls."""

    def pin(p, o):
        if mesh is None:
            return p, o
        return (sharding.constrain(p, sharding.params_sharding(p, mesh, head_dim=cfg.head_dim)),
                sharding.constrain(o, sharding.params_sharding(o, mesh, head_dim=cfg.head_dim)))

    params, opt_state = pin(params, opt_state)
    if mesh is not None:
        batch = sharding.constrain(batch, batch_sharding(mesh, batch))

    def loss_fn(p):
        out = forward_blocks(kind, cfg, p, frozen, batch, jnp.dtype(matmul_dtype))
        return block_loss(kind, *out, vat_head=vat_head, vat_weight=vat_weight)

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics["grad_norm"] = optax.global_norm(grads)
    params, opt_state = pin(params, opt_state)
    return params, opt_state, metrics


@functools.partial(jax.jit, static_argnames=("kind", "cfg"))
def eval_step(params: Params, frozen: Frozen, batch: dict[str, jax.Array], *,
              kind: str, cfg: DrafterConfig) -> dict[str, jax.Array]:
    out = forward_blocks(kind, cfg, params, frozen, batch)
    return block_loss(kind, *out, vat_head=True, vat_weight=False)[1]


# ----------------------------------------------------------------------------- run
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


def positions(args: argparse.Namespace, kind: str, rng: np.random.Generator, lens: np.ndarray,
              plens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pos i32[B, N], valid bool[B, N]): the chain starts / anchors of a batch's rows."""
    r = RECIPES[kind]
    return sample_positions(rng, lens, plens, getattr(args, r.count), *r.window)


def plan_entry(args: argparse.Namespace, plan: list, step: int) -> tuple[int, int, int, list[int]]:
    """(epoch, index in the epoch, sequence bucket, row indices) of batch `step`: each epoch
    visits the plan in a permutation drawn from (seed, epoch)."""
    epoch, i = divmod(step, len(plan))
    seq, idx = plan[np.random.default_rng([args.seed, epoch]).permutation(len(plan))[i]]
    return epoch, i, seq, idx


def batch_for_step(args: argparse.Namespace, rows: Rows, plan: list, step: int,
                   feat_idx: list[int], cfg: DrafterConfig, part: np.ndarray | None = None
                   ) -> dict[str, np.ndarray]:
    """Batch `step` of the run: a pure function of (seed, step) (resumable, deterministic).

    `part` (row indices into the batch, e.g. `sharding.process_rows`): build only those rows —
    the same rows as in the whole batch (positions are drawn for every row from the lengths,
    then cut), without assembling the others' tokens and features.
    """
    epoch, i, seq, idx = plan_entry(args, plan, step)
    kept = [window(len(rows.tokens[r]), rows.plens[r], seq) for r in idx]
    lens = np.asarray([min(len(rows.tokens[r]), seq) for r in idx], np.int32)
    plens = np.asarray([p for _, p in kept], np.int32)
    rng = np.random.default_rng([args.seed, epoch, i, 1])
    pos, valid = positions(args, cfg.kind, rng, lens, plens)
    part = np.arange(len(idx)) if part is None else np.asarray(part)
    b = make_batch(rows, [idx[j] for j in part], seq, feat_idx)
    b["pos"], b["valid"] = pos[part], valid[part]
    return b


def step_batch(args: argparse.Namespace, rows: Rows, plan: list, step: int, feat_idx: list[int],
               cfg: DrafterConfig, mesh: Mesh | None) -> dict[str, jax.Array]:
    """Batch `step` on the devices. On a mesh spanning several processes each process builds
    only the rows its own devices hold and the global batch is assembled from those parts
    (`sharding.place_rows`); otherwise the whole batch is placed."""
    if mesh is None or jax.process_count() == 1:
        return _to_device(mesh, batch_for_step(args, rows, plan, step, feat_idx, cfg))
    size = len(plan_entry(args, plan, step)[3])
    part = sharding.process_rows(mesh, size)
    return sharding.place_rows(batch_for_step(args, rows, plan, step, feat_idx, cfg, part), mesh,
                               size)


@functools.partial(jax.jit, static_argnames=("kind", "cfg"))
def greedy_drafts(params: Params, frozen: Frozen, batch: dict[str, jax.Array], pos: jax.Array,
                  *, kind: str, cfg: DrafterConfig) -> tuple[jax.Array, jax.Array]:
    """What greedy decoding drafts along a batch of text: for every position i32[B, M] of
    `pos` (a chain start / an anchor), (drafts i32[B, M, K], first i32[B, M]): the drafter's
    argmax draft-vocabulary indices for the K tokens from position `first` on, drafted from the
    text before them (the drafter's own outputs in between, as in decoding)."""
    params = with_stats(params, frozen.stats)
    hsel, tpos = RECIPES[kind].hidden(cfg, params, frozen.embed, batch["tokens"],
                                      batch["feats"].astype(jnp.float32), pos)
    drafts = jnp.argmax(draft_logits(cfg, params, frozen.head, hsel), axis=-1)
    return drafts.astype(jnp.int32), tpos[..., 0]


def replay_rounds(target: np.ndarray, drafts: np.ndarray, start: int) -> tuple[int, int]:
    """(tokens emitted, rounds) of greedy speculative decoding replayed along one row of the
    target's own greedy text.

    target: i32[n] the row's tokens as draft-vocabulary indices (-1 outside it: never
    accepted); drafts: i32[n, K] the drafter's K-token draft starting at each position (-1:
    none); start: the first position a round drafts (the one after the token sampled by the
    prefill). A round accepts the longest prefix of its draft that the text continues with and
    emits it plus one target token; the next round drafts from the position after them. On the
    target's greedy text this is exactly what greedy decoding does (the drafter sees the same
    text and features), so emitted / rounds is decoding's τ at K.
    """
    n, kk = len(target), drafts.shape[1]
    pos, rounds = start, 0
    while pos < n:
        a = 0
        while a < kk and pos + a < n and target[pos + a] >= 0 and drafts[pos, a] == target[pos + a]:
            a += 1
        rounds += 1
        pos += a + 1
    return max(n - start, 0), rounds


def drafts_along(params: Params, frozen: Frozen, b: dict[str, np.ndarray], cfg: DrafterConfig,
                 mesh: Mesh | None = None) -> np.ndarray:
    """i32[B, S, K] (host): `greedy_drafts` of a batch's rows indexed by the first drafted
    position (-1 where nothing is drafted from there)."""
    rows, s = b["tokens"].shape
    chunk = RECIPES[cfg.kind].replay_chunk or s
    drafts = None
    for c in range(0, s, chunk):
        pos = np.minimum(np.arange(c, c + chunk, dtype=np.int32), s - 1)
        # Placed like the batch (rows over `data` on a mesh; every process holds all of it).
        dev = _to_device(mesh, {"tokens": b["tokens"], "feats": b["feats"], "lens": b["lens"],
                                "pos": np.ascontiguousarray(np.broadcast_to(pos, (rows, chunk)))})
        d, first = sharding.to_host(greedy_drafts(params, frozen, dev, dev["pos"],
                                                  kind=cfg.kind, cfg=cfg))
        if drafts is None:
            drafts = np.full((rows, s, d.shape[-1]), -1, np.int32)
        ok = (first >= 0) & (first < s)
        r, m = np.nonzero(ok)
        drafts[r, first[r, m]] = d[r, m]
    return drafts


def replay_batch(params: Params, frozen: Frozen, b: dict[str, np.ndarray], cfg: DrafterConfig,
                 mesh: Mesh | None = None) -> tuple[int, int]:
    """(tokens emitted, rounds) of `replay_rounds` summed over a batch's rows."""
    tokens = b["tokens"]
    drafts = drafts_along(params, frozen, b, cfg, mesh)
    to_draft = np.asarray(frozen.to_draft)
    emitted = rounds = 0
    for i in range(len(tokens)):
        n, p = int(b["lens"][i]), int(b["plens"][i])  # p >= 1: drafts exist from p + 1 on
        e, r = replay_rounds(to_draft[tokens[i, :n]], drafts[i, :n], p + 1)
        emitted, rounds = emitted + e, rounds + r
    return emitted, rounds


def evaluate(args, rows, plan, feat_idx, cfg, params, frozen, mesh=None) -> dict[str, float]:
    """Held-out metrics: the means over `plan`'s batches of `block_loss`'s metrics at sampled
    positions, and `tau_replay` — greedy decoding's τ at K = the trained chain / block length,
    replayed along the held-out rows (`replay_rounds`; they are the target's greedy answers),
    pooled over them: tokens per round, as decoding counts it. (`tau_sim` averages 1 + accepted
    over uniformly sampled positions instead, so easy stretches, which decoding crosses in few
    rounds, weigh more: it reads higher than decoding's τ.)"""
    acc: dict[str, list[float]] = {}
    emitted = rounds = 0
    for j in range(len(plan)):
        seq, idx = plan[j]
        b = make_batch(rows, idx, seq, feat_idx)
        rng = np.random.default_rng([args.seed, 10**6 + j])
        b["pos"], b["valid"] = positions(args, cfg.kind, rng, b["lens"], b["plens"])
        m = eval_step(params, frozen, _to_device(mesh, b), kind=cfg.kind, cfg=cfg)
        for k, v in m.items():
            acc.setdefault(k, []).append(float(v))
        e, r = replay_batch(params, frozen, b, cfg, mesh)
        emitted, rounds = emitted + e, rounds + r
    out = {k: float(np.mean(v)) for k, v in acc.items()}
    if rounds:
        out["tau_replay"] = emitted / rounds
    return out


def run(args: argparse.Namespace) -> int:


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
    missing = set(cfg.feature_layers) - set(recorded)
    if missing:
        raise SystemExit(f"error: {args.data} lacks feature layers {sorted(missing)}")
    cols = [recorded.index(i) for i in cfg.feature_layers]
    rows = load_rows(args.data, heldout=False, sets=args.sets, layers=cols)
    feat_idx = list(range(len(cols)))  # rows hold only these columns (then the final-normed)
    try:
        held = load_rows(args.data, heldout=True, sets=args.sets, layers=cols)
    except SystemExit:
        say("warning: no held-out shards (`python -m train datagen --split heldout`): "
              "no held-out evaluation", flush=True)
        held = Rows([], [], [])
        args.eval_every = 0
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
    plan = batches_for(rows, tuple(args.seq_buckets), args.batch_tokens)
    held_plan = (batches_for(held, tuple(args.seq_buckets), args.batch_tokens)[: args.eval_batches]
                 if len(held) else [])
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
        params, _ = split_frozen(RECIPES[cfg.kind].init_params(cfg, jax.random.key(args.seed)))
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


def add_parsers(sub: Any) -> None:
    for kind, help_ in (("eagle3", "train an EAGLE-3 drafter (one layer, training-time test)"),
                        ("dflash", "train a DFlash block-diffusion drafter")):
        p = sub.add_parser(kind, help=help_, description=help_ + ". " + __doc__.split("\n")[2])
        p.set_defaults(func=run, kind=kind)
        p.add_argument("--data", default="runs/data", help="datagen shard directory")
        p.add_argument("--out", default=f"runs/{kind}",
                       help="run directory: checkpoints, log.jsonl, vocab.npy, the drafter file")
        p.add_argument("--name", default="", help="drafter file name (default: the kind)")
        p.add_argument("--model", default="smollm2-135m", help="target model")
        p.add_argument("--sets", nargs="*", default=None,
                       help="prompt sets to train on (default: every set in --data)")
        p.add_argument("--steps", type=int, default=300, help="optimizer steps")
        p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
        p.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
        p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
        p.add_argument("--weight-decay", type=float, default=0.01)
        p.add_argument("--batch-tokens", type=int, default=4096,
                       help="tokens per batch (rows x sequence bucket)")
        p.add_argument("--seq-buckets", type=int, nargs="+", default=[256, 512],
                       help="padded sequence lengths (longer rows keep their last tokens)")
        p.add_argument("--draft-vocab", type=int, default=None,
                       help="draft vocabulary: the most frequent response tokens (default "
                            f"{DEFAULT_DRAFT_VOCAB}; with --init the file's, and a larger N grows "
                            "it: its tokens stay, the next most frequent are added)")
        p.add_argument("--ffn", type=int, default=None,
                       help=f"drafter MLP width (default {RECIPES[kind].ffn}; with --init the "
                            "file's, and a larger N grows it: the new units start with zero "
                            "output weights, so the grown drafter starts as the file's)")
        p.add_argument("--init", default="",
                       help="continue from this drafter, a file or a shipped name (e.g. "
                            "smollm2-135m-eagle3), with its shape, vocabulary and feature "
                            "statistics and a fresh optimizer and schedule: more steps or more "
                            "data on a trained drafter (--draft-vocab and --ffn can grow it)")
        RECIPES[kind].add_args(p)
        p.add_argument("--vat", action="store_true",
                       help="verification-aware training: head + adaptive weighting")
        p.add_argument("--vat-head", action="store_true", help="VAT verification head only")
        p.add_argument("--vat-weight", action="store_true",
                       help="VAT adaptive position weighting only")
        p.add_argument("--ckpt-every", type=int, default=25, help="Orbax checkpoint interval")
        p.add_argument("--stop-after", type=int, default=0,
                       help="stop after this many steps with a checkpoint, as if interrupted "
                            "(the learning-rate schedule stays that of --steps; rerun to go on)")
        p.add_argument("--eval-every", type=int, default=50,
                       help="held-out simulated τ every N steps and at the end (0: never)")
        p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per eval")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--mesh", default="",
                       help="DATAxMODEL, e.g. 2x4: train on a device mesh (batch rows over data; "
                            "heads, MLP, vocabulary over model; jspec.sharding.RULES). Needs "
                            "DATA*MODEL devices (all hosts together)")
        p.add_argument("--distributed", action="store_true",
                       help="call jax.distributed.initialize() first (multi-host: run the same "
                            "command on every host; see docs/SCALING.md)")
        p.add_argument("--matmul-dtype", choices=("float32", "bfloat16"), default="float32",
                       help="operands of the training matmuls (float32 accumulation and float32 "
                            "parameters either way)")
        p.add_argument("--f32", action="store_true",
                       help="write the drafter in float32 (default bfloat16, half the size)")
