"""`python -m jspec calibrate-length`: fit LibraSpec's (n, α) to this machine's cost curve.

1. Measure the verification cost t(K) (forward of K tokens with a filled cache) at the widths
   LibraSpec compiles and at the fixed lengths compared against, and the drafter's cost per block.
2. Probe: decode real prompts greedily (`jspec.generate`'s own rounds) while drafting d_max
   tokens and verifying all of them every round, with a length policy that records per round
   the drafter's confidences q_1..q_dmax (`Recording`); and the oracle length o (leading
   drafted tokens equal to the target's argmax: what greedy lossless verification accepts).
3. Simulate, on those rounds, every fixed K (tokens min(o, K) + 1, time t(K+1) + blocks·t_block)
   and LibraSpec for a grid of (n, α) (Algorithm 1 on the recorded confidences, verify width the
   smallest static width ≥ d); pick the best by tokens per second.

The probe's rounds start where greedy decoding with the full d_max puts them; a different
length moves round boundaries, so the simulation is an estimate (`jspec bench --lengths`
measures the real thing). o is censored at d_max.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import jspec
from jspec import platforms
from jspec.cost import forward_times
from jspec.drafters.base import DraftContext, is_block_drafter
from jspec.errors import JspecError
from jspec.length import FixedLength, LibraSpec, default_widths
from jspec.prompts import load_prompt_set
from jspec.rounds import init_state
from jspec.state import cache_capacity
from jspec.timing import median_time


def algorithm1(conf: np.ndarray, n: int, d_max: int, alpha: float) -> tuple[int, int]:
    """(chosen d, largest d visited) for one round's confidences f[d_max] (ALGORITHMS.md §4)."""
    def eps_star(d: int) -> int:
        s, best = 0.0, None
        for i in range(d, 0, -1):  # S_i = q_i (1 + S_{i+1})
            s = float(conf[i - 1]) * (1.0 + s)
            e = math.floor(alpha * s + i)
            best = e if best is None else min(best, e)
        return best

    d, top = n, n
    while True:
        e = eps_star(d)
        if e <= d:
            return e, top
        if d >= d_max:
            return d, top
        d = min(e, d_max)
        top = max(top, d)


@dataclasses.dataclass(frozen=True)
class Recording(FixedLength):
    """`FixedLength(k)` whose rounds hand the host, in round order, each round's proposal
    confidences f32[B, k], committed length i32[B] (the target cache's) and live rows bool[B]:
    `record(conf, cache_len, live)` (`jax.experimental.io_callback`). The probe's rounds are
    `generate`'s own (`jspec.rounds.speculative_round`), recorded."""

    record: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None

    def draft(self, drafter: Any, dstate: Any, ctx: DraftContext, sampling: jspec.Sampling,
              key: jax.Array, live: jax.Array) -> tuple[Any, Any, jax.Array, jax.Array]:
        prop, dstate, d, need = super().draft(drafter, dstate, ctx, sampling, key, live)
        io_callback(self.record, None, prop.conf, ctx.cache_len, live, ordered=True)
        return prop, dstate, d, need


def probe(model: Any, drafter: Any, prompts: list[list[int]], d_max: int, max_new_tokens: int,
          progress: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding (`jspec.generate`, lossless) that drafts and verifies d_max tokens every
    round, recording the drafter's confidences per round (`Recording`).

    Returns (conf f32[R, d_max], oracle i32[R]) over all rounds of all prompts: a round's
    oracle length is its accepted count (greedy lossless verification accepts the leading
    drafted tokens equal to the target's argmax), read from how far the next round's committed
    length moved (the last round's: the accepted total less the others).
    """

    rounds: list[tuple[np.ndarray, int]] = []  # (conf f32[d_max], cache length) per round

    def record(conf: np.ndarray, cache_len: np.ndarray, live: np.ndarray) -> None:
        if live[0]:
            rounds.append((np.asarray(conf[0], np.float32), int(cache_len[0])))

    policy = Recording(d_max, record=record)
    all_c, all_o = [], []
    for ids in prompts:
        rounds.clear()
        out = jspec.generate(model, np.asarray([ids], np.int32), drafter=drafter,
                             verifier=jspec.Lossless(), length=policy,
                             max_new_tokens=max_new_tokens)
        accepted = int(out.stats.accepted[0])  # waits for the decode
        jax.effects_barrier()
        starts = [c for _, c in rounds]
        o = [b - a - 1 for a, b in itertools.pairwise(starts)]
        o += [accepted - sum(o)] if rounds else []
        all_c += [c for c, _ in rounds]
        all_o += o
        if progress is not None:
            progress.update(1)
    return (np.asarray(all_c, np.float32).reshape(-1, d_max), np.asarray(all_o, np.int32))


def verify_times(model: Any, ks: list[int], fill: int, repeats: int) -> dict[int, float]:
    """Seconds per target forward of K new tokens, cache filled to `fill` (`jspec.cost`,
    interleaved), made non-decreasing in K (a running maximum), since on XLA:CPU a few shapes
    measure faster than smaller ones and a cost model that rewards verifying more would be
    fitting noise."""
    med = forward_times(model, ks, fill, repeats)
    out, top = {}, 0.0
    for k in sorted(med):
        top = max(top, med[k])
        out[k] = top
    return out


def block_time(model: Any, drafter: Any, fill: int, repeats: int) -> float:
    """Seconds per drafter block (`extend`) with `fill` context slots."""

    ids = jnp.full((1, fill), 42, jnp.int32)
    cap = cache_capacity(fill, 8, 8, platforms.of_arrays(model.weights))
    init = jax.jit(functools.partial(init_state, model.config, sampling=jspec.Sampling(),
                                     max_new_tokens=8, capacity=cap, eos_ids=model.eos_ids, k=8,
                                     length=LibraSpec(n=1, d_max=8)))
    state = init(model.weights, drafter, ids, jnp.asarray([fill], jnp.int32), jax.random.key(0))
    ctx = DraftContext(seq=state.seq, cache_len=state.cache.lengths, last=state.last)
    fn = jax.jit(lambda d, s: d.extend(s, ctx, ctx.last, 1, jspec.Sampling(),
                                       jax.random.key(0))[0])
    return median_time(lambda: jax.block_until_ready(fn(drafter, state.drafter)), repeats)


def interp(times: dict[int, float], k: int) -> float:
    """t(k) by linear interpolation between measured points."""
    xs = sorted(times)
    if k in times:
        return times[k]
    return float(np.interp(k, xs, [times[x] for x in xs]))


def simulate(conf: np.ndarray, oracle: np.ndarray, t_verify: dict[int, float], t_block: float,
             bs: int, d_max: int, widths: tuple[int, ...], fixed: list[int],
             ns: list[int], alphas: list[float]) -> dict[str, Any]:
    """Tokens/s of every fixed K and LibraSpec (n, α) on the recorded rounds."""
    t1 = t_verify[1]
    res: dict[str, Any] = {"fixed": {}, "libraspec": []}
    for k in fixed:
        tok = float(np.sum(np.minimum(oracle, k) + 1))
        sec = len(oracle) * (interp(t_verify, k + 1) + math.ceil(k / bs) * t_block)
        res["fixed"][k] = {"speedup": tok / sec * t1,
                           "gap": float(np.mean(np.abs(k - oracle)))}
    for n in ns:
        for a in alphas:
            tok, sec, gap, dsum = 0.0, 0.0, 0.0, 0
            for c, o in zip(conf, oracle, strict=True):
                d, top = algorithm1(c, n, d_max, a)
                w = next(x for x in widths if x >= d)
                tok += min(int(o), d) + 1
                sec += interp(t_verify, w + 1) + math.ceil(max(n, top) / bs) * t_block
                gap += abs(d - int(o))
                dsum += d
            res["libraspec"].append({"n": n, "alpha": a, "speedup": tok / sec * t1,
                                     "gap": gap / len(oracle), "mean_d": dsum / len(oracle)})
    return res


def main(args: argparse.Namespace) -> int:

    try:
        from tqdm import tqdm  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        tqdm = None
    model = jspec.load_model(args.model)
    drafter = jspec.load_drafter(args.drafter, target=model)
    if not is_block_drafter(drafter):
        raise JspecError(f"calibrate-length needs a block drafter (DFlash), not {args.drafter!r}")
    d_max, bs = args.d_max, drafter.caps.block_tokens
    widths = default_widths(d_max)
    fixed = list(range(1, min(16, d_max) + 1))
    t0 = time.time()
    ks = sorted({1, *(w + 1 for w in widths), *(k + 1 for k in (1, 2, 3, 4, 6, 8, 12, 16)
                                                   if k <= d_max)})
    print(f"measuring t(K) for K in {ks} (one compile each) ...", flush=True)
    t_verify = verify_times(model, ks, args.fill, args.repeats)
    t_block = block_time(model, drafter, args.fill, args.repeats)
    rows = load_prompt_set(args.prompts)
    prompts = [model.encode(r["text"]) for r in rows]
    bar = tqdm(total=len(prompts), desc="probe", unit="prompt") if tqdm else None
    conf, oracle = probe(model, drafter, prompts, d_max, args.max_new_tokens, bar)
    if bar:
        bar.close()
    ns = sorted({n for n in (1, 2, 3, 4, bs, 2 * bs, 16) if n <= d_max})
    alphas = [round(0.1 * 1.25 ** i, 4) for i in range(26)]  # 0.1 .. ~26
    sim = simulate(conf, oracle, t_verify, t_block, bs, d_max, widths, fixed, ns, alphas)
    best_k = max(sim["fixed"], key=lambda k: sim["fixed"][k]["speedup"])
    best = max(sim["libraspec"], key=lambda r: r["speedup"])
    default = next((r for r in sim["libraspec"] if r["n"] == min(16, d_max)
                    and abs(r["alpha"] - 2.2) < 0.3), None)
    c = {k: t_verify[k] / t_verify[1] for k in sorted(t_verify)}
    out = {"model": args.model, "drafter": args.drafter, "prompts": args.prompts,
           "rounds": len(oracle), "d_max": d_max, "block_tokens": bs, "fill": args.fill,
           "c": c, "t1_ms": 1000 * t_verify[1], "block_ms": 1000 * t_block,
           "mean_oracle": float(oracle.mean()), "best_fixed": {"k": best_k, **sim["fixed"][best_k]},
           "best": best, "fixed": sim["fixed"], "grid": sim["libraspec"],
           "seconds": time.time() - t0}
    args.out.write_text(json.dumps(out, indent=1))
    # The recorded rounds, for re-simulation without re-decoding.
    np.savez(args.out.with_suffix(".npz"), conf=conf, oracle=oracle,
             t_verify=np.asarray([[k, t] for k, t in sorted(t_verify.items())]),
             t_block=np.float64(t_block))
    print(f"\nc(K) on this machine (fill {args.fill}): "
          + " ".join(f"c({k})={v:.2f}" for k, v in c.items())
          + f"; one drafter block = {t_block / t_verify[1]:.2f} t(1)")
    print(f"{len(oracle)} probe rounds, mean oracle length {oracle.mean():.2f} (censored at "
          f"{d_max})")
    print(f"best fixed K = {best_k}: simulated speedup {sim['fixed'][best_k]['speedup']:.3f}x, "
          f"mean |K - oracle| {sim['fixed'][best_k]['gap']:.2f}")
    if default:
        print(f"LibraSpec defaults (n={default['n']}, alpha={default['alpha']}): "
              f"{default['speedup']:.3f}x, mean d {default['mean_d']:.2f}, "
              f"|d - oracle| {default['gap']:.2f}")
    print(f"best LibraSpec n={best['n']}, alpha={best['alpha']}: {best['speedup']:.3f}x "
          f"(simulated, {best['speedup'] / sim['fixed'][best_k]['speedup'] - 1:+.1%} vs best "
          f"fixed), mean d {best['mean_d']:.2f}, |d - oracle| {best['gap']:.2f}")
    print(f"use: --length libraspec:n={best['n']},d_max={d_max},alpha={best['alpha']}  "
          f"(saved to {args.out})")
    return 0
