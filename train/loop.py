"""The one training loop of `python -m train eagle3 | dflash | d2sd`.

A drafter's trainer supplies its parameters, a step function and an evaluation; the loop does
the rest the same way for all of them: the Optax optimizer (AdamW, warmup + cosine decay,
global-norm clipping), Orbax checkpoints every `ckpt_every` steps and at the end (a rerun of
the same command resumes from the last one: batches are functions of (seed, step), so a
resumed run is the run that would have happened), a progress bar with the running loss and
simulated acceptance, periodic held-out evaluation, a JSONL log (and its picture), and only
process 0 writing the log under a multi-process run (`writer`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

from jspec.errors import JspecError
from jspec.plot import plot_training

StepFn = Callable[[Any, Any, int], tuple[Any, Any, dict[str, Any]]]
EvalFn = Callable[[Any], dict[str, float]]


def optimizer(args: argparse.Namespace) -> Any:
    """AdamW (β 0.9 / 0.95, `--weight-decay`) on a warmup + cosine schedule to 5% of `--lr`,
    after clipping the global norm to `--clip`."""

    warmup = min(args.warmup, max(args.steps - 1, 0))
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(args.steps, warmup + 1),
                                               end_value=args.lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(args.clip),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=args.weight_decay))


@dataclasses.dataclass
class Loop:
    """What one drafter's training gives the loop.

    step: (params, opt_state, step) -> (params, opt_state, metrics of that step).
    evaluate: params -> held-out metrics (None: no held-out data).
    shown: metrics on the progress bar (running averages); `tau_sim` and `loss` are logged
      for every step whatever is shown.
    eval_at_start: evaluate the initial parameters (a fine-tune's starting point) as step 0.
    """

    step: StepFn
    evaluate: EvalFn | None
    shown: tuple[str, ...]
    eval_at_start: bool = False


def plot_log(log: Path) -> Path | None:
    """training.png (loss, held-out τ) next to the run's log.jsonl, when matplotlib is
    installed (the `plot` extra); None otherwise."""
    try:
        path = plot_training(log, log.with_name("training.png"))
    except JspecError as e:  # no matplotlib, or an empty log
        print(f"no training plot: {e}", flush=True)
        return None
    print(f"wrote {path}", flush=True)
    return path


def finish_checkpoints(mngr: Any, steps: int, state: dict[str, Any]) -> None:
    """Wait for the asynchronous Orbax saves and make sure step `steps` is saved (a rerun that
    found every step done still leaves its final checkpoint)."""

    mngr.wait_until_finished()
    if steps > 0 and mngr.latest_step() != steps:
        mngr.save(steps, args=ocp.args.StandardSave(state), force=True)
        mngr.wait_until_finished()


def run_loop(loop: Loop, params: Any, opt_state: Any, out: Path, *, steps: int,
             ckpt_every: int, eval_every: int, stop_after: int = 0, writer: bool = True,
             say: Callable[..., None] = print) -> tuple[Any, Any, int]:
    """Train from the last checkpoint in `out/ckpt` (or from `params`) to `steps` (or to
    `stop_after`, checkpointed, to go on later). Returns (params, opt_state, last step)."""

    mngr = ocp.CheckpointManager(out / "ckpt", options=ocp.CheckpointManagerOptions(
        max_to_keep=2, save_interval_steps=ckpt_every))
    step = 0
    log = open(out / "log.jsonl" if writer else os.devnull, "a")  # noqa: SIM115 (closed below)
    if mngr.latest_step() is not None:
        step = int(mngr.latest_step())
        restored = mngr.restore(step, args=ocp.args.StandardRestore(
            {"params": params, "opt_state": opt_state}))
        params, opt_state = restored["params"], restored["opt_state"]
        say(f"resumed from the checkpoint at step {step}", flush=True)
    elif loop.eval_at_start and eval_every and loop.evaluate is not None:
        ev = loop.evaluate(params)
        say("step 0 (the initial drafter): held-out " + _fmt(ev), flush=True)
        log.write(json.dumps({"step": 0, **{f"heldout_{k}": v for k, v in ev.items()}}) + "\n")
    end = max(step, min(steps, stop_after)) if stop_after else steps
    bar = tqdm(range(step, end), initial=step, total=steps, unit="step", dynamic_ncols=True,
               disable=not writer)
    t0 = time.perf_counter()
    ema: dict[str, float] = {}
    for step in bar:
        params, opt_state, m = loop.step(params, opt_state, step)
        m = {k: float(v) for k, v in m.items()}
        for k, v in m.items():
            ema[k] = v if k not in ema else 0.9 * ema[k] + 0.1 * v
        bar.set_postfix({k: f"{ema[k]:.3f}" if k == "loss" else f"{ema[k]:.2f}"
                         for k in loop.shown if k in ema})
        rec = {"step": step + 1, **m, "time": time.perf_counter() - t0}
        done = step + 1
        if eval_every and loop.evaluate is not None and (done % eval_every == 0
                                                         or done == steps):
            ev = loop.evaluate(params)
            rec.update({f"heldout_{k}": v for k, v in ev.items()})
            if writer:
                bar.write(f"step {done}: held-out " + _fmt(ev))
        log.write(json.dumps(rec) + "\n")
        log.flush()
        mngr.save(done, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
    log.close()
    if writer:
        plot_log(out / "log.jsonl")
    finish_checkpoints(mngr, end, {"params": params, "opt_state": opt_state})
    if end < steps:
        say(f"stopped after step {end} of {steps} (checkpointed; run again without "
            "--stop-after to go on)", flush=True)
    return params, opt_state, end


def _fmt(ev: dict[str, float]) -> str:
    keys = [k for k in ("tau_replay", "tau_sim", "acc1", "acc_first", "loss") if k in ev]
    return " ".join(f"{k} {ev[k]:.3f}" for k in keys)
