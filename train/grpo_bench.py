"""Measurements behind docs/RL.md: rollout speed speculative vs plain, and learning curves of two
`python -m train grpo` runs compared step by step.

  python -m train grpo --bench-rollouts 5          # tokens/s of step 0's rollout, both ways
  python -m train grpo --evaluate 64 --out runs/a  # the start vs the last checkpoint
  python -m train.grpo_bench runs/a/log.jsonl runs/b/log.jsonl   # reward curves, paired
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

import jspec
from jspec.models.model import Model
from train.grpo import (
    GRPOConfig,
    drafter_optimizer,
    init_state,
    merge,
    split_policy,
    step_batch,
    trained_part,
    with_trained_part,
)
from train.grpo_tasks import Tasks, answer_reward, arithmetic_tasks, token_classes
from train.loop import optimizer


def restore(model: Model, drafter: Any, args: argparse.Namespace) -> tuple[int, dict, Any]:
    """(the step, the policy's trained parameters, the drafter as the run left it) of the last
    checkpoint in `args.out` (the drafter: with its online-trained parameters under
    `--drafter-lr`, else as given)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    _, params0 = split_policy(model.weights, args.train_layers)
    mngr = ocp.CheckpointManager(Path(args.out).resolve() / "ckpt")
    last = mngr.latest_step()
    if last is None:
        raise SystemExit(f"no checkpoint in {args.out}/ckpt")
    state, opt = init_state(params0, drafter, optimizer(args), drafter_optimizer(args, drafter))
    try:
        state = mngr.restore(last, args=ocp.args.StandardRestore(
            {"params": state, "opt_state": opt}))["params"]
    except ValueError:  # written before the online drafter step (2026-12-08): the policy alone
        state = {"policy": mngr.restore(last, args=ocp.args.StandardRestore(
            {"params": params0, "opt_state": opt[0]}))["params"], "drafter": None}
    if state["drafter"] is not None:
        drafter = with_trained_part(drafter, dataclasses.replace(trained_part(drafter),
                                                                  params=state["drafter"]))
    return last, state["policy"], drafter


def bench_rollouts(model: Model, drafter: Any, tasks: Tasks, cfg: GRPOConfig,
                   args: argparse.Namespace) -> dict[str, float]:
    """Time `args.bench_rollouts` rollouts of step 0's batch (P*G rows) with the drafter and as
    many without, alternating (the same keys both ways), each jitted with the weights as an
    argument as in the RL step. Prints and returns tokens/s, mean length and reward of each,
    and τ. `args.at_checkpoint`: the policy and drafter of the last checkpoint in `args.out`
    (re-bound to that policy unless `args.no_rebind`) instead of the initial ones."""
    if drafter is None:
        raise SystemExit("--bench-rollouts compares against a drafter: give --drafter")
    batch, key = step_batch(tasks, cfg, args.seed, 0)
    weights, step = model.weights, 0
    if getattr(args, "at_checkpoint", False):
        frozen, _ = split_policy(model.weights, args.train_layers)
        step, params, drafter = restore(model, drafter, args)
        model = dataclasses.replace(model, config=model.config.replace(tie_embeddings=False),
                                    weights=merge(frozen, params))
        weights = model.weights
        if not getattr(args, "no_rebind", False):  # a frozen run's drafter keeps its copies
            drafter = jspec.bind(drafter, weights)
    classes = token_classes(model.tokenizer, model.config.vocab_size)

    @functools.partial(jax.jit, static_argnames="spec")
    def rollout(weights, drafter, batch, key, spec):
        out = jspec.generate(Model(config=model.config, weights=weights), batch.ids, batch.lens,
                             drafter=drafter if spec else None, key=key,
                             max_new_tokens=cfg.max_new_tokens,
                             sampling=jspec.Sampling(temperature=cfg.temperature),
                             length=jspec.FixedLength(cfg.k) if spec else None)
        st = out.stats
        return (out.lengths.sum(), st.emitted.sum() / jax.numpy.maximum(st.rounds.sum(), 1),
                answer_reward(out.tokens, batch.answers, classes).sum())

    res: dict[str, list[float]] = {f"{w}_{x}": [] for w in ("spec", "plain")
                                   for x in ("s", "tok", "reward")}
    res["tau"] = []
    for spec in (True, False):  # compile both first
        jax.block_until_ready(rollout(weights, drafter, batch, key, spec))
    for r in range(args.bench_rollouts):
        k = jax.random.fold_in(key, r)
        for spec in (True, False):
            t0 = time.perf_counter()
            n, tau, rew = jax.block_until_ready(rollout(weights, drafter, batch, k, spec))
            name = "spec" if spec else "plain"
            res[f"{name}_s"].append(time.perf_counter() - t0)
            res[f"{name}_tok"].append(float(n))
            res[f"{name}_reward"].append(float(rew))
            if spec:
                res["tau"].append(float(tau))
    summary = {f"{w}_tokens_per_s": sum(res[f"{w}_tok"]) / sum(res[f"{w}_s"])
               for w in ("spec", "plain")}
    rows = int(batch.ids.shape[0])
    summary.update({f"{w}_mean_length": float(np.mean(res[f"{w}_tok"])) / rows
                    for w in ("spec", "plain")})
    summary.update({f"{w}_reward": float(np.sum(res[f"{w}_reward"])) / (rows * args.bench_rollouts)
                    for w in ("spec", "plain")})
    summary.update(tau=float(np.mean(res["tau"])), rows=rows, step=step,
                   repeats=args.bench_rollouts, loadavg=os.getloadavg()[0])
    summary["speedup"] = summary["spec_tokens_per_s"] / summary["plain_tokens_per_s"]
    print(json.dumps(summary), flush=True)
    return summary


def held_out(train: Tasks, tasks: Tasks, n: int) -> Tasks:
    """The first `n` of `tasks` whose expression is not among `train`'s (the first operations
    span a small space: about half of a seed's draws repeat another seed's)."""
    seen = set(train.texts)
    keep = [i for i, t in enumerate(tasks.texts) if t not in seen][:n]
    if len(keep) < n:
        raise SystemExit(f"only {len(keep)} held-out tasks (asked {n}): raise the pool")
    return Tasks(tasks.ids[keep], tasks.lens[keep], tasks.answers[keep],
                 tuple(tasks.texts[i] for i in keep))


def evaluate(model: Model, drafter: Any, classes: np.ndarray, cfg: GRPOConfig,
             args: argparse.Namespace) -> dict[str, float]:
    """Reward of the initial policy and of the last checkpoint in `args.out` on two fixed sets:
    the training tasks (`--tasks` of seed 0: what the run optimised) and `args.evaluate`
    held-out tasks (seed 1, expressions absent from the training set): greedy, and G samples
    each at the run's temperature with the same keys for both policies (a paired comparison).
    Plain decoding (speculation changes no distribution), batches of P*G rows."""
    train = arithmetic_tasks(model, args.tasks, seed=0, task=args.task)
    sets = {"train": train,
            "heldout": held_out(train, arithmetic_tasks(model, 20 * args.evaluate, seed=1,
                                                        task=args.task), args.evaluate)}
    frozen, params0 = split_policy(model.weights, args.train_layers)
    last, params1, _ = restore(model, drafter, args)
    mcfg = model.config.replace(tie_embeddings=False)
    rows = cfg.prompts * cfg.group

    @functools.partial(jax.jit, static_argnames="temperature")
    def reward(params, ids, lens, answers, key, temperature):
        m = Model(config=mcfg, weights=merge(frozen, params))
        out = jspec.generate(m, ids, lens, max_new_tokens=cfg.max_new_tokens,
                             sampling=jspec.Sampling(temperature=temperature),
                             key=key if temperature > 0 else None)
        return answer_reward(out.tokens, answers, classes)

    res: dict[str, Any] = {"step": last}
    for set_name, tasks in sets.items():
        for name, p in (("start", params0), ("end", params1)):
            for temp, g in ((0.0, 1), (cfg.temperature, cfg.group)):
                idx = np.repeat(np.arange(len(tasks.answers)), g)
                total = 0.0
                for b in range(0, len(idx), rows):
                    real = idx[b:b + rows]  # a short last batch repeats its first task
                    sel = np.concatenate([real, np.full(rows - len(real), real[0])])
                    r = reward(p, tasks.ids[sel], tasks.lens[sel], tasks.answers[sel],
                               jax.random.fold_in(jax.random.key(1), b), temp)
                    total += float(np.asarray(r)[:len(real)].sum())
                res[f"{set_name}_{name}_T{temp:g}"] = total / len(idx)
                res[f"{set_name}_n_T{temp:g}"] = len(idx)
    res.update(samples_per_task=cfg.group, loadavg=os.getloadavg()[0])
    print(json.dumps(res), flush=True)
    return res


def _rewards(log: Path, key: str) -> dict[int, float]:
    recs = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    return {r["step"]: r[key] for r in recs if key in r}


def compare(a: Path, b: Path, key: str = "reward", rows: int = 16) -> dict[str, float]:
    """Paired comparison of `key` per step of two runs with the same seed (the same prompts
    each step): mean of each, the mean difference and its standard error over steps, the
    t statistic. `rows`: rollouts per step (for the stated sample size)."""
    ra, rb = _rewards(a, key), _rewards(b, key)
    steps = sorted(set(ra) & set(rb))
    if len(steps) < 2:
        raise SystemExit("fewer than 2 common steps")
    d = np.asarray([ra[s] - rb[s] for s in steps])
    se = float(d.std(ddof=1) / math.sqrt(len(d)))
    out = {"steps": len(steps), "rollouts_each": len(steps) * rows,
           "mean_a": float(np.mean([ra[s] for s in steps])),
           "mean_b": float(np.mean([rb[s] for s in steps])),
           "mean_diff": float(d.mean()), "se_diff": se,
           "t": float(d.mean() / se) if se > 0 else 0.0}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m train.grpo_bench", description=__doc__)
    p.add_argument("log_a", type=Path)
    p.add_argument("log_b", type=Path)
    p.add_argument("--key", default="reward", help="the logged metric to compare")
    p.add_argument("--rows", type=int, default=16, help="rollouts per step (P x G)")
    a = p.parse_args()
    compare(a.log_a, a.log_b, a.key, a.rows)
    sys.exit(0)
