"""A/B timing on one host: arms called in alternation, every ratio taken between calls seconds apart.

On a shared host whose speed drifts over minutes, timing one arm over everything and then the
other compares different moments. Here every round (a repeat, or a prompt) calls every arm once,
in an order that rotates by one from round to round, and each ratio is formed within a round;
the report is its median with the quartiles over the rounds (the spread), next to the pooled one.

  forward    the target's forward of T new tokens (`jspec.cost.forward_call`, batch 1, cache
             filled to --fill) compiled under each arm's environment, which the compiler reads
             at trace time (default: XLA's dot against the CPU small-M GEMM kernel,
             `JSPEC_CPU_GEMM` 0 / 1): ms per T, c(T) = t(T) / t(smallest T) of the first arm,
             and each arm's time over the first arm's.
      python scripts/ab.py forward [--sizes 1,2,3,4,6,8,12,16] [--fill 400] [--repeats 9]
                                   [--dtype float32] [--arm NAME:VAR=VALUE[,VAR=VALUE]] ...
  generate   speculative configurations against plain decoding on real prompts, batch 1,
             lossless: each prompt is decoded by every configuration in turn, once to warm up
             and once timed: tokens/s, the speedup per prompt (median, quartiles), pooled over
             all prompts and per prompt set, τ; one JSON line per temperature.
      python scripts/ab.py generate [--temperatures 0,1] [--prompts P] SPEC@K [SPEC@K ...]
      e.g. python scripts/ab.py generate smollm2-135m-eagle3+ngram:look=4@2
  checkouts  `generate` in fresh processes alternating between checkouts (PYTHONPATH = each;
             this file is run from here and uses only jspec's public API, so an older
             checkout needs nothing new): each checkout's tokens/s over the first's, per round.
      python scripts/ab.py checkouts --rounds 3 DIR_A DIR_B -- [generate arguments]
  profile    where a batch-1 round's time goes, by named scope and operation: one warm-up
             `generate` per prompt, then each prompt under `jax.profiler.trace`; every XLA:CPU
             thunk is attributed to the jax operation it came from (the optimized HLO's
             op_name, layer numbers folded) and summed per round (autoregressive, --spec none:
             per token). --show-other lists the thunks XLA inserted (no op_name). Run it on an
             idle machine.
      python scripts/ab.py profile [--spec S] [--k K] [--dtype D] [--prompts P] [--temperature T]

Earlier one script each; the journal cites them as git keeps them (`git show REV:PATH`):
4e34597:scripts/paired_speed.py (generate), 7d67b95:scripts/small_gemm_ab.py (forward),
7f767a8:scripts/spec_speed.py (checkouts), 3b80dac:scripts/round_profile.py (profile).
"""

from __future__ import annotations

import os
import sys
import tempfile

if __name__ == "__main__" and sys.argv[1:2] == ["profile"]:  # before jax starts
    DUMP = tempfile.mkdtemp(prefix="jspec-hlo-")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP}"
                               " --xla_dump_hlo_as_text")

import argparse
import collections
import glob
import gzip
import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.prompts import load_prompt_set

MODEL = "smollm2-135m"


# ----------------------------------------------------------------------------- pairing
def paired(arms: dict[Any, Callable[[], Any]], rounds: int, warmup: int = 1, start: int = 0
           ) -> tuple[dict[Any, np.ndarray], dict[Any, Any]]:
    """Call every arm once per round, `warmup` untimed rounds first, round r in the order
    rotated to start at arm (start + r) % len(arms).

    Returns:
      (seconds f64[rounds] per arm, each arm's last result).
    """
    names = list(arms)
    secs = {n: np.zeros(rounds) for n in names}
    last: dict[Any, Any] = {}
    for r in range(-warmup, rounds):
        for j in range(len(names)):
            n = names[(start + r + j) % len(names)]
            t0 = time.perf_counter()
            last[n] = jax.block_until_ready(arms[n]())
            if r >= 0:
                secs[n][r] = time.perf_counter() - t0
    return secs, last


def spread(x: Any) -> dict[str, float]:
    """Median and quartiles of paired ratios f[n]."""
    q25, med, q75 = np.percentile(np.asarray(x, np.float64), [25, 50, 75])
    return {"median": float(med), "q25": float(q25), "q75": float(q75), "n": len(x)}


def fmt(s: dict[str, float]) -> str:
    return f"{s['median']:.2f}x ({s['q25']:.2f}-{s['q75']:.2f})"


# ----------------------------------------------------------------------------- forward
def parse_arm(text: str) -> tuple[str, dict[str, str]]:
    """NAME:VAR=VALUE[,VAR=VALUE] -> (NAME, {VAR: VALUE})."""
    name, _, env = text.partition(":")
    return name, dict(kv.split("=", 1) for kv in env.split(",") if kv)


def forward_ab(model: Any, arms: list[tuple[str, dict[str, str]]], sizes: list[int], fill: int,
               repeats: int) -> dict[str, Any]:
    """Each arm's forward of T new tokens for every T in `sizes`, all (arm, T) calls paired.

    Returns:
      {"ms": {arm: {T: median ms}}, "c": {arm: {T: t / t(smallest T) of the first arm}},
       "ratio": {arm: {T: spread of t(arm) / t(first arm)}}}.
    """
    # here, not at the top: an older checkout under `checkouts` may lack them
    from jspec import cost, platforms
    from jspec.state import cache_capacity

    sizes = sorted(set(sizes))
    cache = cost.filled_cache(model, fill, cache_capacity(
        fill, max(sizes), platform=platforms.of_arrays(model.weights)))
    calls = {}
    for name, env in arms:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            for t in sizes:
                calls[(name, t)] = cost.forward_call(model, t, fill, cache)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    secs, _ = paired(calls, repeats, warmup=0)
    base, t1 = arms[0][0], sizes[0]
    ms = {a: {t: 1e3 * float(np.median(secs[(a, t)])) for t in sizes} for a, _ in arms}
    return {"ms": ms, "c": {a: {t: ms[a][t] / ms[base][t1] for t in sizes} for a in ms},
            "ratio": {a: {t: spread(secs[(a, t)] / secs[(base, t)]) for t in sizes}
                      for a in ms}}


def cmd_forward(a: argparse.Namespace) -> None:
    arms = [parse_arm(x) for x in (a.arm or ["xla:JSPEC_CPU_GEMM=0", "kernel:JSPEC_CPU_GEMM=1"])]
    sizes = [int(s) for s in a.sizes.split(",")]
    res = forward_ab(jspec.load_model(a.model, dtype=a.dtype), arms, sizes, a.fill, a.repeats)
    names = [n for n, _ in arms]
    print(f"{a.dtype}, fill {a.fill}, median of {a.repeats} paired repeats (ms; c = t(T) / "
          f"t({sizes[0]}) of {names[0]}; ratio: time over {names[0]}'s, median (quartiles))")
    print("T    " + "".join(f"{n:>10s} {'c':>6s}  " for n in names)
          + "".join(f"{n + '/' + names[0]:>24s}" for n in names[1:]))
    for t in sizes:
        print(f"{t:<4} " + "".join(f"{res['ms'][n][t]:10.2f} {res['c'][n][t]:6.2f}  "
                                   for n in names)
              + "".join(f"{fmt(res['ratio'][n][t]):>24s}" for n in names[1:]))
    print(json.dumps({"forward": res, "dtype": a.dtype, "fill": a.fill}))


# ----------------------------------------------------------------------------- generate
def generate_ab(model: Any, configs: list[tuple[str, dict[str, Any]]],
                rows: list[tuple[str, list[int]]], temperature: float, new_tokens: int,
                say: Callable[[str], None] = print) -> dict[str, Any]:
    """Every prompt decoded by every configuration in turn (`paired`, one warm-up round, the
    order rotating from prompt to prompt); configs[0] is the baseline (plain decoding).

    rows: (prompt set, token ids) per prompt. Returns a JSON-ready summary: per configuration
    tokens/s, the pooled ratio to the baseline, its spread over prompts, τ, pooled per set.
    """
    sampling = jspec.Sampling(temperature=temperature)
    n = len(configs)
    sec, tok, rounds, emitted = (np.zeros((n, len(rows))) for _ in range(4))
    for i, (_, ids) in enumerate(rows):
        x = jnp.asarray([ids])
        arms = {j: (lambda kw=kw, x=x, i=i: jspec.generate(
            model, x, max_new_tokens=new_tokens, sampling=sampling, key=jax.random.key(i), **kw))
            for j, (_, kw) in enumerate(configs)}
        secs, outs = paired(arms, 1, warmup=1, start=i)
        for j in range(n):
            sec[j, i] = secs[j][0]
            tok[j, i] = int(np.asarray(outs[j].lengths)[0])
            rounds[j, i] = float(np.asarray(outs[j].stats.rounds)[0])
            emitted[j, i] = float(np.asarray(outs[j].stats.emitted)[0])
        say(f"T={temperature:g} prompt {i + 1}/{len(rows)}")
    sets = list(dict.fromkeys(s for s, _ in rows))
    tps = tok / sec
    per_prompt = tps / tps[0]  # f[C, P] each prompt's speedup over the baseline
    out = {"temperature": temperature, "jspec": jspec.__file__, "rows": []}
    for j, (name, _) in enumerate(configs):
        pooled = lambda m, j=j: float(tok[j, m].sum() / sec[j, m].sum()  # noqa: E731
                                      / (tok[0, m].sum() / sec[0, m].sum()))
        by_set = {s: pooled([i for i, (ps, _) in enumerate(rows) if ps == s]) for s in sets}
        out["rows"].append({
            "config": name, "tokens_per_s": float(tok[j].sum() / sec[j].sum()),
            "vs_ar": pooled(slice(None)), "vs_ar_spread": spread(per_prompt[j]),
            "tau": float(emitted[j].sum() / max(rounds[j].sum(), 1.0)) if j else 1.0,
            "vs_ar_by_set": by_set})
    return out


def configs_of(model: Any, specs: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """[("autoregressive", {}), (SPEC@K, generate keywords), ...]."""
    out: list[tuple[str, dict[str, Any]]] = [("autoregressive", {})]
    for c in specs:
        spec, k = c.rsplit("@", 1)
        out.append((c, {"drafter": jspec.load_drafter(spec, target=model),
                        "length": jspec.FixedLength(int(k))}))
    return out


def prompt_rows(model: Any, prompts: str) -> list[tuple[str, list[int]]]:
    return [(part, model.encode(r["text"])) for part in prompts.split(",")
            for r in load_prompt_set(part)]


def cmd_generate(a: argparse.Namespace) -> None:
    model = jspec.load_model(a.model, dtype=a.dtype)
    configs, rows = configs_of(model, a.configs), prompt_rows(model, a.prompts)
    for temp in (float(t) for t in a.temperatures.split(",")):
        res = generate_ab(model, configs, rows, temp, a.new_tokens,
                          say=lambda s: print(s, flush=True))
        res["prompts"] = a.prompts
        sets = list(res["rows"][0]["vs_ar_by_set"])
        print(f"\nT = {temp:g}: {len(rows)} prompts, {a.new_tokens} new tokens, {a.dtype}, "
              f"batch 1, each prompt's calls back to back; vs AR pooled, per prompt median "
              "(quartiles), per set")
        print(f"{'configuration':64s} tok/s  vs AR  per prompt          tau   " + "  ".join(sets))
        for r in res["rows"]:
            print(f"{r['config']:64s} {r['tokens_per_s']:5.1f}  {r['vs_ar']:.2f}x "
                  f"{fmt(r['vs_ar_spread']):19s} {r['tau']:.2f}  "
                  + "  ".join(f"{v:.2f}x" for v in r["vs_ar_by_set"].values()))
        print(json.dumps(res), flush=True)


# ----------------------------------------------------------------------------- checkouts
def cmd_checkouts(a: argparse.Namespace) -> None:
    dirs = [os.path.abspath(d) for d in a.dirs]  # the same one twice: an A/A run
    runs: list[list[list[dict]]] = [[] for _ in dirs]  # per checkout, per round: JSON lines
    for r in range(a.rounds):
        for j in range(len(dirs)):
            c = (r + j) % len(dirs)
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "generate",
                                *a.generate_args], env=dict(os.environ, PYTHONPATH=dirs[c]),
                               capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(f"generate under {dirs[c]} failed:\n{p.stderr[-3000:]}")
            res = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
            print(f"round {r + 1}/{a.rounds} checkout {c} ({dirs[c]}): jspec from "
                  f"{res[0]['jspec']}", flush=True)
            runs[c].append(res)
    summary = []
    for ti, first in enumerate(runs[0][0]):
        print(f"\nT = {first['temperature']:g}: per checkout, tokens/s (median over "
              f"{a.rounds} rounds) and over checkout 0's, per round: median (quartiles)")
        for ci, row in enumerate(first["rows"]):
            ref = np.asarray([run[ti]["rows"][ci]["tokens_per_s"] for run in runs[0]])
            per = []
            for c in range(len(dirs)):
                tps = np.asarray([run[ti]["rows"][ci]["tokens_per_s"] for run in runs[c]])
                per.append({"checkout": dirs[c], "tokens_per_s": float(np.median(tps)),
                            "vs_first": spread(tps / ref)})
            summary.append({"temperature": first["temperature"], "config": row["config"],
                            "checkouts": per})
            print(f"  {row['config']:60s} " + "  ".join(
                f"{x['tokens_per_s']:6.1f} {fmt(x['vs_first'])}" for x in per))
    print(json.dumps({"checkouts": dirs, "rounds": a.rounds, "rows": summary}))


# ----------------------------------------------------------------------------- profile
SKIP = ("Thunk", "Slinky", "PjRt", "Pjit", "Handle", "Parse", "Allocate", "RefManager", "while")
SCOPES = ("prefill", "draft", "verify", "accept", "commit")


def cmd_profile(a: argparse.Namespace) -> None:
    if "--xla_dump_to" not in os.environ.get("XLA_FLAGS", ""):
        raise SystemExit("profile: run it as `python scripts/ab.py profile` (XLA_FLAGS is set "
                         "before jax starts)")
    dump = re.search(r"--xla_dump_to=(\S+)", os.environ["XLA_FLAGS"]).group(1)
    model = jspec.load_model(a.model, dtype=a.dtype)
    kw: dict = {"max_new_tokens": a.new_tokens}
    if a.temperature:
        kw["sampling"] = jspec.Sampling(temperature=a.temperature)
        kw["key"] = jax.random.key(0)
    if a.spec != "none":
        kw["drafter"] = jspec.load_drafter(a.spec, target=model)
        kw["length"] = jspec.FixedLength(a.k)
    rows = [ids for _, ids in prompt_rows(model, a.prompts)]
    for ids in rows:
        jax.block_until_ready(jspec.generate(model, jnp.asarray([ids]), **kw).tokens)
    trace_dir = tempfile.mkdtemp(prefix="jspec-trace-")
    rounds = tokens = 0
    wall = 0.0
    with jax.profiler.trace(trace_dir):
        for ids in rows:
            t0 = time.perf_counter()
            out = jspec.generate(model, jnp.asarray([ids]), **kw)
            jax.block_until_ready(out.tokens)
            wall += time.perf_counter() - t0
            n = int(np.asarray(out.lengths)[0])
            tokens += n
            rounds += int(np.asarray(out.stats.rounds)[0]) if a.spec != "none" else n
    hlo = [Path(p).read_text() for p in glob.glob(f"{dump}/*cpu_after_optimizations.txt")]
    op_of = {m.group(1): m.group(2) for text in hlo for m in re.finditer(
        r"%([\w.\-]+) = [^\n]*?metadata=\{op_name=\"([^\"]+)\"", text)}
    with gzip.open(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    per, scope = collections.Counter(), collections.Counter()
    for e in events:
        name = e.get("name", "")
        if name.startswith(("$", "end:")) or any(s in name for s in SKIP):
            continue
        parts = re.sub(r"layer_\d+", "layer_N", op_of.get(name, "(no op_name)")).split("/")
        scope[next((p for p in parts if p in SCOPES), "other")] += e["dur"]
        per[(name.split(".")[0], "/".join(p for p in parts if not p.startswith(
            ("jit(", "while", "closed_call"))))] += e["dur"]
    total, r = sum(per.values()), max(rounds, 1)
    print(f"{a.spec} K {a.k} {a.dtype} {a.prompts}: {tokens} tokens, {rounds} rounds (tau "
          f"{tokens / r:.2f}), wall {1000 * wall / r:.1f} ms a round incl. prefill, "
          f"thunks {total / r / 1000:.1f} ms a round")
    for sc, us in scope.most_common():
        print(f"  {sc:8s} {us / r / 1000:7.2f} ms a round  {100 * us / total:5.1f}%")
    if a.show_other:
        line = {m.group(1): m.group(2)[:160] for text in hlo for m in re.finditer(
            r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$", text, re.M)}
        other, count = collections.Counter(), collections.Counter()
        for e in events:
            if e.get("name") in line and e["name"] not in op_of:
                other[e["name"]] += e["dur"]
                count[e["name"]] += 1
        for name, us in other.most_common(12):
            print(f"{us / r / 1000:8.2f} ms  {count[name]:5d}x  {name}: {line[name]}")
    for (kind, op), us in per.most_common(30):
        print(f"{us / r / 1000:8.2f} ms  {100 * us / total:5.1f}%  {kind:22s} {op[-100:]}")


# ----------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("forward", help="the target's forward under each arm's environment")
    f.add_argument("--sizes", default="1,2,3,4,6,8,12,16")
    f.add_argument("--fill", type=int, default=400)
    f.add_argument("--repeats", type=int, default=9)
    f.add_argument("--dtype", default="float32")
    f.add_argument("--arm", action="append", help="NAME:VAR=VALUE[,VAR=VALUE] (repeatable)")
    g = sub.add_parser("generate", help="configurations against plain decoding, per prompt")
    g.add_argument("configs", nargs="*", help="drafter spec @ K")
    g.add_argument("--prompts", default="humaneval:0-8,gsm8k:0-8,mtbench:60-68")
    g.add_argument("--temperatures", default="0,1")
    g.add_argument("--new-tokens", type=int, default=96)
    g.add_argument("--dtype", default="bfloat16")
    c = sub.add_parser("checkouts", help="`generate` alternating between checkouts")
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("dirs", nargs="+", help="checkout directories (PYTHONPATH of each run)")
    pr = sub.add_parser("profile", help="a round's time by named scope and operation")
    pr.add_argument("--spec", default="smollm2-135m-eagle3+ngram:look=4", help="or none")
    pr.add_argument("--k", type=int, default=2)
    pr.add_argument("--dtype", default="bfloat16")
    pr.add_argument("--prompts", default="humaneval:0-2")
    pr.add_argument("--temperature", type=float, default=0.0)
    pr.add_argument("--new-tokens", type=int, default=96)
    pr.add_argument("--show-other", action="store_true")
    for s in (f, g, pr):
        s.add_argument("--model", default=MODEL)
    argv = sys.argv[1:] if argv is None else argv
    rest: list[str] = []
    if "--" in argv:  # checkouts: what follows `--` goes to each run's `generate`
        argv, rest = argv[: argv.index("--")], argv[argv.index("--") + 1:]
    a = p.parse_args(argv)
    a.generate_args = rest
    {"forward": cmd_forward, "generate": cmd_generate, "checkouts": cmd_checkouts,
     "profile": cmd_profile}[a.cmd](a)


if __name__ == "__main__":
    main()
