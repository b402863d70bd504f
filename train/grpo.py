"""`python -m train grpo`: GRPO on SmolLM2-135M-Instruct over the shipped arithmetic tasks, with
speculative rollouts, the whole RL step in one jitted function.

One step (`make_step`, one `jax.jit`, compiled once):
  1. rollout: `jspec.bind` the drafter to the current policy's weights (its copies of the LM-head
     rows and embedding; `--no-rebind` keeps the initial ones), then `jspec.generate` G samples
     of each of P prompts at temperature T, speculatively (lossless: the samples are distributed
     as plain decoding's), returning the tokens and their log-probs under the policy;
  2. reward: 1 when the completion's last number is the exact answer (`grpo_tasks`);
  3. group advantages: (r - mean of its group) / (std of its group + 1e-4);
  4. loss: the clipped PPO/GRPO surrogate per token, ratio = exp(log p_new - log p_rollout),
     log p_new from one teacher-forced forward over prompt + completion under the current
     parameters (`jspec.logprobs`; the rollout's log-probs are the old policy: the same
     parameters, so the ratio is 1 up to float32 rounding and the gradient is REINFORCE with
     group baselines; they matter once a rollout is reused), averaged over each completion's
     tokens, then over rows; no KL term (Dr. GRPO / DAPO drop it);
  5. an Optax update (AdamW, clipping, `train.loop.optimizer`);
  6. with `--drafter-lr` > 0, an online drafter step: the EAGLE-3 / DFlash drafter trains on
     the rollout it just drafted (`train.step.drafter_step` on the target features that
     `generate(..., features=True)` returned), so it follows the policy beyond re-binding.

What trains: the last `--train-layers` decoder layers, the final norm and the LM head (untied from
the input embedding, so the gradient never runs through the frozen layers below). A step with all
30 layers trained took 2.3x as long on 2 CPU cores (docs/RL.md). The LM head is what the
EAGLE-3 drafter copies, so re-binding has something to refresh.

Static (recompiles): the model config, P, G, max new tokens, T, k, the drafter's kind.
Dynamic: the policy's parameters, optimizer state, the drafter's arrays, prompts, answers, key.
Prompts of a step and its key are functions of (--seed, step), so a killed run rerun with the
same command resumes from its last Orbax checkpoint (every --ckpt-every steps) and continues
as the uninterrupted run would have.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jspec
from jspec.drafters.base import Proposer, settings_of
from jspec.errors import JspecError
from jspec.models.model import Model
from jspec.tasks import math_correct
from train.grpo_tasks import Tasks, answer_reward, arithmetic_tasks, token_classes
from train.loop import Loop, optimizer, run_loop
from train.step import drafter_step, init_opt


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """The static settings of the RL step (changing one recompiles)."""

    prompts: int = 8  # P prompts per step
    group: int = 8  # G samples per prompt
    max_new_tokens: int = 5  # the longest answer (3 digits) after a space, and one more
    temperature: float = 1.0
    ppo_clip: float = 0.2  # PPO ratio clip ε
    k: int = 2  # drafted tokens per round (ignored without a drafter)
    rebind: bool = True  # bind the drafter to the current weights before each rollout
    drafter_positions: int = 8  # online drafter step: chain starts drawn per rollout row

    def __post_init__(self):
        if self.prompts < 1 or self.group < 2:
            raise JspecError("GRPO needs >= 1 prompt and >= 2 samples per prompt (a group)")
        if self.temperature <= 0 or self.max_new_tokens < 1 or self.k < 1:
            raise JspecError("temperature > 0, max_new_tokens >= 1 and k >= 1 are required")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    """One step's prompts: P prompts, each repeated G times (rows of a group are adjacent)."""

    ids: jax.Array  # i32[P*G, W] right-padded
    lens: jax.Array  # i32[P*G]
    answers: jax.Array  # i32[P*G]


def split_policy(weights: jspec.Weights, train_layers: int) -> tuple[jspec.Weights, dict]:
    """(frozen weights with an untied head, trainable params in float32): the last
    `train_layers` layers, the final norm and the LM head [D, V]."""
    n = len(weights.layers)
    if not 0 <= train_layers <= n:
        raise JspecError(f"--train-layers must lie in 0..{n}")
    head = weights.embed.T if weights.lm_head is None else weights.lm_head
    f32 = functools.partial(jax.tree.map, lambda a: jnp.array(a, jnp.float32))  # a copy: donated
    params = {"layers": f32(weights.layers[n - train_layers:]),
              "final_norm": f32(weights.final_norm), "lm_head": f32(head)}
    frozen = dataclasses.replace(weights, layers=weights.layers[:n - train_layers],
                                 lm_head=None)
    return frozen, params


def merge(frozen: jspec.Weights, params: dict) -> jspec.Weights:
    """The policy's weights (in the frozen weights' dtype) from the split of `split_policy`."""
    dt = frozen.embed.dtype
    cast = functools.partial(jax.tree.map, lambda a: a.astype(dt))
    return dataclasses.replace(frozen, layers=frozen.layers + tuple(cast(params["layers"])),
                               final_norm=params["final_norm"], lm_head=cast(params["lm_head"]))


def group_advantages(rewards: jax.Array, group: int) -> jax.Array:
    """f32[B]: each reward minus its group's mean, over the group's std (+1e-4)."""
    r = rewards.reshape(-1, group)
    adv = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)
    return adv.reshape(-1)


def trained_part(drafter: Any) -> Any:
    """The EAGLE-3 / DFlash drafter that an online step trains, inside its proposers."""
    return trained_part(drafter.inner) if isinstance(drafter, Proposer) else drafter


def with_trained_part(drafter: Any, part: Any) -> Any:
    """`drafter` with `trained_part(drafter)` replaced by `part`."""
    if isinstance(drafter, Proposer):
        return dataclasses.replace(drafter, inner=with_trained_part(drafter.inner, part))
    return part


def init_state(params: dict, drafter: Any, tx: optax.GradientTransformation,
               dtx: optax.GradientTransformation | None) -> tuple[dict, tuple]:
    """The RL step's carried state: ({"policy": params, "drafter": the trained drafter's
    parameters or None}, (the policy's optax state, the drafter's or None)). `dtx` None: no
    online drafter step."""
    if dtx is None:
        return {"policy": params, "drafter": None}, (tx.init(params), None)
    part = trained_part(drafter)
    copy = jax.tree.map(jnp.copy, part.params)  # donated by the step: not the drafter's own
    return {"policy": params, "drafter": copy}, (tx.init(params), init_opt(part, dtx))


def _rl_step(cfg: GRPOConfig, mcfg: jspec.ModelConfig, tx: optax.GradientTransformation,
             dtx: optax.GradientTransformation | None, frozen: jspec.Weights, state: dict,
             opt_state: tuple, drafter: Any, batch: Batch, classes: jax.Array,
             key: jax.Array) -> tuple[dict, tuple, dict, jax.Array]:
    params, dparams = state["policy"], state["drafter"]
    opt_state, dopt = opt_state
    online = dparams is not None
    if online:  # the drafter as the online steps left it
        drafter = with_trained_part(drafter, dataclasses.replace(trained_part(drafter),
                                                                  params=dparams))
    weights = merge(frozen, params)
    sampling = jspec.Sampling(temperature=cfg.temperature)
    if drafter is not None and cfg.rebind:
        drafter = jspec.bind(drafter, weights)
    with jax.named_scope("rollout"):
        out = jspec.generate(Model(config=mcfg, weights=weights), batch.ids, batch.lens,
                             drafter=drafter, max_new_tokens=cfg.max_new_tokens, key=key,
                             sampling=sampling,
                             length=None if drafter is None else jspec.FixedLength(cfg.k),
                             features=online)
    with jax.named_scope("reward"):
        reward = answer_reward(out.tokens, batch.answers, classes)
        adv = group_advantages(reward, cfg.group)[:, None]
    mask = (jnp.arange(cfg.max_new_tokens)[None] < out.lengths[:, None]).astype(jnp.float32)

    def loss_fn(p: dict) -> tuple[jax.Array, jax.Array]:
        policy = Model(config=mcfg, weights=merge(frozen, p))
        lp = jspec.logprobs(policy, batch.ids, batch.lens, out.tokens, sampling=sampling)
        ratio = jnp.exp(lp - out.logprobs)
        clipped = jnp.clip(ratio, 1 - cfg.ppo_clip, 1 + cfg.ppo_clip)
        surrogate = jnp.minimum(ratio * adv, clipped * adv)
        per_row = jnp.sum(surrogate * mask, 1) / jnp.maximum(jnp.sum(mask, 1), 1.0)
        return -jnp.mean(per_row), jnp.max(jnp.abs(ratio - 1) * mask)

    with jax.named_scope("update"):
        (loss, ratio_dev), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    st = out.stats
    metrics = {"loss": loss, "reward": reward.mean(), "ratio_dev": ratio_dev,
               "grad_norm": optax.global_norm(grads), "length": out.lengths.mean(),
               "tau": st.emitted.sum() / jnp.maximum(st.rounds.sum(), 1),
               "accept": st.accepted.sum() / jnp.maximum(st.drafted.sum(), 1),
               "tokens": out.lengths.sum()}
    if online:
        with jax.named_scope("drafter_step"):
            part, dopt, dm = drafter_step(trained_part(drafter), dopt, out, batch.lens,
                                          jax.random.fold_in(key, 1), tx=dtx,
                                          positions=cfg.drafter_positions)
        dparams = part.params
        metrics["drafter_loss"] = dm["loss"]
    return {"policy": params, "drafter": dparams}, (opt_state, dopt), metrics, out.tokens


def make_step(cfg: GRPOConfig, mcfg: jspec.ModelConfig, tx: optax.GradientTransformation,
              dtx: optax.GradientTransformation | None = None):
    """The jitted RL step `(frozen, state, opt_state, drafter, batch, classes, key) -> (state,
    opt_state, metrics, tokens i32[P*G, N])` over `init_state`'s state (donated); `dtx`: the
    online drafter step's optimizer (None: no online step)."""
    return jax.jit(functools.partial(_rl_step, cfg, mcfg, tx, dtx),
                   donate_argnames=("state", "opt_state"))


def step_batch(tasks: Tasks, cfg: GRPOConfig, seed: int, step: int) -> tuple[Batch, jax.Array]:
    """Step `step`'s prompts (P distinct tasks, each G times) and rollout key: functions of
    (seed, step) only, so a resumed run repeats what the uninterrupted one would have done."""
    idx = np.random.default_rng([seed, step]).choice(len(tasks.answers), cfg.prompts,
                                                     replace=False)
    rows = np.repeat(idx, cfg.group)
    batch = Batch(jnp.asarray(tasks.ids[rows]), jnp.asarray(tasks.lens[rows]),
                  jnp.asarray(tasks.answers[rows]))
    return batch, jax.random.fold_in(jax.random.key(seed), step)


def train(model: Model, drafter: Any, tasks: Tasks, classes: np.ndarray, cfg: GRPOConfig,
          args: argparse.Namespace, out: Path, decode: Any = None) -> tuple[dict, Any, int]:
    """Run GRPO from the last checkpoint in `out/ckpt` to `args.steps` (or `args.stop_after`).
    `args` holds the optimizer's settings (`train.loop.optimizer`), train_layers, seed,
    steps, ckpt_every, stop_after, drafter_lr (optional). `decode` (ids -> text), when given,
    adds the host check of the reward (`jspec.tasks.math_correct` on the decoded text) to the
    log. Returns (`init_state`'s state, the optax states, the last step)."""
    frozen, params = split_policy(model.weights, args.train_layers)
    mcfg = model.config.replace(tie_embeddings=False)
    tx = optimizer(args)
    dtx = drafter_optimizer(args, drafter)
    params, opt_state = init_state(params, drafter, tx, dtx)
    step_fn = make_step(cfg, mcfg, tx, dtx)
    classes = jnp.asarray(classes)

    def step(params: dict, opt_state: Any, i: int) -> tuple[dict, Any, dict]:
        batch, key = step_batch(tasks, cfg, args.seed, i)
        t0 = time.perf_counter()
        params, opt_state, m, tokens = step_fn(frozen, params, opt_state, drafter, batch,
                                               classes, key)
        m = {k: float(v) for k, v in m.items()}
        m["seconds"] = time.perf_counter() - t0
        if decode is not None:
            toks = np.asarray(tokens)
            m["reward_host"] = float(np.mean([math_correct(str(a), decode(t)) for a, t in
                                              zip(np.asarray(batch.answers), toks, strict=True)]))
        return params, opt_state, m

    loop = Loop(step=step, evaluate=None, shown=("reward", "tau", "loss"))
    return run_loop(loop, params, opt_state, out, steps=args.steps, ckpt_every=args.ckpt_every,
                    eval_every=0, stop_after=args.stop_after)


def drafter_optimizer(args: argparse.Namespace, drafter: Any
                      ) -> optax.GradientTransformation | None:
    """Adam at `--drafter-lr` for the online drafter step (None when it is 0)."""
    lr = getattr(args, "drafter_lr", 0.0)
    if not lr:
        return None
    if drafter is None:
        raise JspecError("--drafter-lr trains the rollout drafter: give one (not --drafter none)")
    return optax.adam(lr)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = jspec.load_model(args.model, dtype="float32")
    drafter = None
    if args.drafter != "none":
        drafter = jspec.load_drafter(args.drafter, target=model, best=True)
    cfg = GRPOConfig(prompts=args.prompts, group=args.group, max_new_tokens=args.max_new,
                     temperature=args.temperature, ppo_clip=args.ppo_clip,
                     k=args.k or (settings_of(drafter).k if drafter is not None else 2),
                     rebind=not args.no_rebind)
    tasks = arithmetic_tasks(model, args.tasks, seed=0, task=args.task)
    classes = token_classes(model.tokenizer, model.config.vocab_size)
    print(f"GRPO: {len(tasks.answers)} '{args.task}' tasks, P={cfg.prompts} x G={cfg.group}, "
          f"drafter {args.drafter} (k={cfg.k}, {'re-bound' if cfg.rebind else 'frozen'}), "
          f"training the last {args.train_layers} layers + final norm + LM head", flush=True)
    if args.evaluate:
        from train.grpo_bench import evaluate  # noqa: PLC0415
        evaluate(model, drafter, classes, cfg, args)
        return 0
    if args.bench_rollouts:
        from train.grpo_bench import bench_rollouts  # noqa: PLC0415
        bench_rollouts(model, drafter, tasks, cfg, args)
        return 0
    train(model, drafter, tasks, classes, cfg, args, out, decode=model.decode)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("grpo", help="GRPO on the arithmetic tasks with speculative rollouts",
                       description=__doc__.split("\n\n")[0] + " Details: docs/RL.md.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="policy (target) model, float32")
    p.add_argument("--drafter", default="smollm2-135m-eagle3",
                   help="rollout drafter, loaded with its measured-best configuration for this "
                        "machine class (the shipped EAGLE-3 gives +ngram:look=4, k=2 on "
                        "cpu-bf16); 'none': plain sampled decoding")
    p.add_argument("--k", type=int, default=0, help="drafted tokens per round (0: the "
                   "drafter's measured settings, jspec.drafters.base.settings_of)")
    p.add_argument("--no-rebind", action="store_true",
                   help="keep the drafter's initial copies of the policy's tensors (frozen)")
    p.add_argument("--task", choices=("first", "full"), default="first",
                   help="first: each shipped problem's first operation; full: its whole "
                        "computation and shipped answer (grpo_tasks.py)")
    p.add_argument("--tasks", type=int, default=64,
                   help="problems generated (seed 0): the training set")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (P)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--max-new", type=int, default=5, help="new tokens per sample")
    p.add_argument("--temperature", type=float, default=1.0, help="rollout temperature")
    p.add_argument("--ppo-clip", type=float, default=0.2, help="PPO ratio clip ε")
    p.add_argument("--train-layers", type=int, default=2,
                   help="last decoder layers trained (with the final norm and LM head)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW peak learning rate")
    p.add_argument("--drafter-lr", type=float, default=0.0,
                   help="online drafter step after each policy update: Adam at this rate on "
                        "the rollout's target features (EAGLE-3 / DFlash; 0: none, the "
                        "drafter only re-binds)")
    p.add_argument("--warmup", type=int, default=0, help="warmup steps")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=80, help="RL steps (cosine decay to 5%% of "
                   "--lr over them)")
    p.add_argument("--ckpt-every", type=int, default=5, help="Orbax checkpoint interval")
    p.add_argument("--stop-after", type=int, default=0,
                   help="stop (checkpointed) after this step; rerun without it to go on")
    p.add_argument("--seed", type=int, default=0, help="prompts and rollout keys of each step")
    p.add_argument("--out", default="runs/grpo",
                   help="run directory: ckpt/ (rerunning the same command resumes from it), "
                        "log.jsonl (one line per step)")
    p.add_argument("--bench-rollouts", type=int, default=0, metavar="R",
                   help="instead of training: time R rollouts of step 0's batch with the "
                        "drafter and R without, alternating, and print tokens/s (grpo_bench)")
    p.add_argument("--at-checkpoint", action="store_true",
                   help="--bench-rollouts with the policy and drafter of the last checkpoint in "
                        "--out (re-bound unless --no-rebind) instead of the initial ones")
    p.add_argument("--evaluate", type=int, default=0, metavar="N",
                   help="instead of training: reward of the initial policy and of the last "
                        "checkpoint in --out on the training tasks and on N held-out ones "
                        "(seed 1, expressions not in training), greedy and G samples each "
                        "(grpo_bench)")
    p.set_defaults(func=run)
