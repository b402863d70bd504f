"""`python -m jspec calibrate-length`: fit LibraSpec's (n, α) to this machine's cost curve.

1. Measure the verification cost t(K) (forward of K tokens with a filled cache) at the widths
   LibraSpec compiles and at the fixed lengths compared against, and the drafter's cost per block.
2. Probe: decode real prompts greedily while drafting d_max tokens and verifying all of them
   every round; record per round the drafter's confidences q_1..q_dmax and the oracle length o
   (leading drafted tokens equal to the target's argmax).
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
import json
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec import platforms
from jspec.bench import _median_time
from jspec.cost import forward_times
from jspec.decode import _init_jit
from jspec.drafters.base import DraftContext
from jspec.errors import JspecError
from jspec.length import LibraSpec, default_widths
from jspec.models.llama import forward
from jspec.prompts import load_prompt_set
from jspec.sampling import argmax
from jspec.state import bucket_length, cache_capacity, commit, features
from jspec.verify.lossless import leading_true


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


def probe(model: Any, drafter: Any, prompts: list[list[int]], d_max: int, max_new_tokens: int,
          progress: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding that drafts and verifies d_max tokens every round.

    Returns (conf f32[R, d_max], oracle i32[R]) over all rounds of all prompts.
    """

    cfg = model.config
    greedy = jspec.Sampling()
    policy = LibraSpec(n=min(drafter.caps.block_tokens, d_max), d_max=d_max)
    fl = drafter.caps.feature_layers

    @jax.jit
    def step(weights, drafter, state):
        ctx = DraftContext(seq=state.seq, cache_len=state.cache.lengths, last=state.last)
        toks, _, ds = drafter.propose(state.drafter, ctx, d_max, greedy, state.key)
        conf = ds.conf  # f32[B, d_max]
        ds = dataclasses.replace(ds, conf=state.drafter.conf, vhat=state.drafter.vhat,
                                 hidden=state.drafter.hidden)  # keep the carried shapes
        valid = toks >= 0
        draft = jnp.where(valid, toks, 0)
        inp = jnp.concatenate([state.last[:, None], draft], axis=1)
        pos = state.cache.lengths[:, None] + jnp.arange(d_max + 1, dtype=jnp.int32)[None]
        out = forward(cfg, weights, inp, pos, state.cache, hidden_layers=fl)
        tgt = argmax(out.logits)
        o = leading_true(valid & (draft == tgt[:, :d_max]))
        ds = drafter.observe(ds, features(out.hidden, drafter.caps.feature_norm), state.cache.lengths,
                             o + 1)
        rows = jnp.arange(draft.shape[0])
        emitted = jnp.concatenate([draft, jnp.zeros_like(o)[:, None]], axis=1)
        emitted = emitted.at[rows, o].set(tgt[rows, o])
        live = ~state.done
        new = commit(state, emitted, o + 1, model.eos_ids, out.cache, o, d_max)
        return dataclasses.replace(new, drafter=ds), live, o, conf

    all_c, all_o = [], []
    for ids in prompts:
        width = bucket_length(len(ids))
        arr = np.zeros((1, width), np.int32)
        arr[0, :len(ids)] = ids
        cap = cache_capacity(width, max_new_tokens, d_max, platforms.of_arrays(model.weights))
        state = _init_jit(model.weights, drafter, jspec.Lossless(), jnp.asarray(arr),
                          jnp.asarray([len(ids)], jnp.int32), jax.random.key(0), config=cfg,
                          sampling=greedy, max_new_tokens=max_new_tokens, capacity=cap,
                          eos_ids=model.eos_ids, k=d_max, length=policy, mesh=None)
        while not bool(state.done[0]):
            state, live, o, c = step(model.weights, drafter, state)
            if bool(live[0]):
                all_c.append(np.asarray(c[0]))
                all_o.append(int(o[0]))
        if progress is not None:
            progress.update(1)
    return np.asarray(all_c, np.float32), np.asarray(all_o, np.int32)


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
    state = _init_jit(model.weights, drafter, jspec.Lossless(), ids,
                      jnp.asarray([fill], jnp.int32), jax.random.key(0), config=model.config,
                      sampling=jspec.Sampling(), max_new_tokens=8,
                      capacity=cache_capacity(fill, 8, 8, platforms.of_arrays(model.weights)),
                      eos_ids=model.eos_ids, k=8,
                      length=LibraSpec(n=1, d_max=8), mesh=None)
    ctx = DraftContext(seq=state.seq, cache_len=state.cache.lengths, last=state.last)
    fn = jax.jit(lambda d, s: d.extend(s, ctx, ctx.last, 1, jspec.Sampling(),
                                       jax.random.key(0))[0])
    return _median_time(lambda: jax.block_until_ready(fn(drafter, state.drafter)), repeats)


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
    if not hasattr(drafter, "extend"):
        raise JspecError(f"calibrate-length needs a block drafter (DFlash), not {args.drafter!r}")
    d_max, bs = args.d_max, drafter.block_tokens
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
