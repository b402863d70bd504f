"""`python -m jspec bench`: speed measured side by side in one run, medians over repeats."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec import bench_batch, peer
from jspec.cost import cost_curve, tree_cost
from jspec.drafters.base import is_block_drafter
from jspec.errors import JspecError
from jspec.length import parse_length
from jspec.models import registry
from jspec.models.cache import KVCache
from jspec.models.llama import forward
from jspec.prompts import load_prompt_set
from jspec.provenance import provenance
from jspec.specs import split_list
from jspec.state import bucket_length
from jspec.tables import print_table
from jspec.tasks import score
from jspec.timing import median_time
from jspec.verify import DiversedState, Lossless, parse_verifier, with_acceptance_impl

AR_FLOAT32 = "autoregressive float32"  # the float32 baseline row of a --dtype bfloat16 run
BENCH_PROMPT = ("Write a Python function that checks whether a string is a palindrome, "
                "then explain how it works.")


def decode_tps(model: Any, prompt_ids: list[int], new_tokens: int, repeats: int,
               batch: int = 1) -> dict[str, float]:
    """Greedy autoregressive tokens/s of `jspec.generate` (prefill excluded by subtraction),
    summed over `batch` copies of the prompt decoded together."""


    # EOS is ignored so that every run decodes exactly `new_tokens` tokens.
    model = dataclasses.replace(model, config=model.config.replace(eos_ids=()))
    ids = jnp.asarray([prompt_ids] * batch, jnp.int32)  # i32[batch, P]
    n_out = []

    def run(n: int) -> Any:
        def go():
            out = jspec.generate(model, ids, max_new_tokens=n)
            n_out.append(int(np.asarray(out.lengths).sum()))
        return go
    # Decode rate: the 1-token run (prefill + first token) is subtracted.
    t_full = median_time(run(new_tokens), repeats)
    full_tokens = n_out[-1]
    t_pre = median_time(run(1), repeats)
    decoded = max(full_tokens - batch, 1)
    return {"tokens_per_s": decoded / max(t_full - t_pre, 1e-9),
            "end_to_end_tokens_per_s": full_tokens / t_full, "new_tokens": full_tokens,
            "seconds": t_full, "prefill_seconds": t_pre}


def baseline(args: argparse.Namespace) -> dict[str, Any]:

    model = jspec.load_model(args.model).with_attention_impl(args.attention_impl)
    prompt = model.encode(BENCH_PROMPT)
    ks = (1, 2, 4, 8, 16)
    res: dict[str, Any] = {"machine": platform.processor() or platform.machine(),
                           "jax": jax.__version__, "new_tokens": args.new_tokens,
                           "repeats": args.repeats, "prompt_tokens": len(prompt)}
    res["jspec_f32"] = decode_tps(model, prompt, args.new_tokens, args.repeats)
    res["jspec_c"] = cost_curve(model, ks, args.fill, max(args.repeats, 5))
    if not args.no_bf16:
        res["jspec_bf16"] = decode_tps(model.astype("bfloat16"), prompt, args.new_tokens,
                                       args.repeats)
        res["jspec_c_bf16"] = cost_curve(model.astype("bfloat16"), ks, args.fill,
                                         max(args.repeats, 5))
    use_peer = not args.no_peer and peer.hf_available() and args.model in registry.REGISTRY
    if use_peer:
        hf_dir = str(registry.converted_dir(registry.REGISTRY[args.model]))
        res["hf_f32"] = peer.hf_decode_tps(hf_dir, prompt, args.new_tokens, "float32", args.repeats)
        if not args.no_bf16:
            res["hf_bf16"] = peer.hf_decode_tps(hf_dir, prompt, args.new_tokens, "bfloat16",
                                                args.repeats)
        res["hf_c"] = peer.hf_cost_curve(hf_dir, ks=ks, fill=args.fill, dtype="float32",
                                         repeats=max(args.repeats, 5))
    rows = []
    for key, engine, dt in (("jspec_f32", "jspec", "float32"), ("jspec_bf16", "jspec", "bfloat16"),
                            ("hf_f32", "HF transformers", "float32"),
                            ("hf_bf16", "HF transformers", "bfloat16")):
        if key in res:
            r = res[key]
            decode = r.get("decode_tokens_per_s", r["tokens_per_s"]) if key.startswith("hf") \
                else r["tokens_per_s"]
            e2e = r["tokens_per_s"] if key.startswith("hf") else r["end_to_end_tokens_per_s"]
            res[key]["decode_rate"] = decode
            rows.append([engine, dt, f"{decode:.1f}", f"{e2e:.1f}"])
    print_table(f"Autoregressive greedy decoding, batch 1, {len(prompt)}-token prompt, "
                 f"{args.new_tokens} new tokens (median of {args.repeats})",
                 ["engine", "dtype", "decode tokens/s", "end-to-end tokens/s"], rows)
    hf_best = max((res[k]["decode_rate"] for k in ("hf_f32", "hf_bf16") if k in res), default=None)
    if hf_best:
        ratio = res["jspec_f32"]["decode_rate"] / hf_best
        res["jspec_over_hf_best"] = ratio
        print(f"jspec float32 / HF best dtype: {ratio:.2f}x")
    crow = [["jspec", *[f"{res['jspec_c']['c'][k]:.2f}" for k in ks]],
            ["jspec ms", *[f"{res['jspec_c']['ms'][k]:.1f}" for k in ks]]]
    if "jspec_c_bf16" in res:
        crow.append(["jspec bfloat16", *[f"{res['jspec_c_bf16']['c'][k]:.2f}" for k in ks]])
        crow.append(["jspec bfloat16 ms", *[f"{res['jspec_c_bf16']['ms'][k]:.1f}" for k in ks]])
    if "hf_c" in res:
        crow.append(["HF", *[f"{res['hf_c']['ratio'][k]:.2f}" for k in ks]])
        crow.append(["HF ms", *[f"{1000 * res['hf_c']['seconds'][k]:.1f}" for k in ks]])
    print_table(f"Verification cost c(K) = t(K)/t(1), cache fill {args.fill} (float32 unless "
                 "marked)",
                 ["", *[f"K={k}" for k in ks]], crow)
    return res


def speculative(args: argparse.Namespace) -> dict[str, Any]:
    """Speculative rows: every drafter x K x temperature against autoregressive decoding of the
    same target on the same prompts, in one run. batch 1, prompts one at a time."""

    try:
        from tqdm import tqdm  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        tqdm = None
    model = jspec.load_model(args.model, dtype=args.dtype).with_attention_impl(args.attention_impl)
    # A target in another dtype than float32 also gets a float32 autoregressive row, so every
    # speedup can be read against the faster of the two autoregressive baselines.
    ref_model = (jspec.load_model(args.model).with_attention_impl(args.attention_impl)
                 if args.dtype != "float32" else None)
    rows = load_prompt_set(args.prompts)
    enc = [model.encode(r["text"]) for r in rows]
    width = bucket_length(max(map(len, enc)))  # one width for all prompts: one compile per config
    padded = np.zeros((len(enc), width), np.int32)
    for i, e in enumerate(enc):
        padded[i, : len(e)] = e
    lengths = np.asarray([len(e) for e in enc], np.int32)
    set_of = [r["set"] for r in rows]
    sets = list(dict.fromkeys(set_of))

    ks = [int(k) for k in args.ks.split(",")]
    # "name@K1/K2" gives a drafter its own speculation lengths (e.g. DFlash's block - 1).
    drafter_ks: dict[str, list[int]] = {}
    for spec in split_list(args.drafters):
        name, _, own = spec.partition("@")
        try:
            own_ks = [int(x) for x in own.split("/")] if own else ks
        except ValueError as e:
            raise JspecError(f"bad drafter lengths in {spec!r}: use name@K or name@K1/K2") from e
        # A name given twice ("d@2,d@3") runs both lengths, as "d@2/3" does.
        drafter_ks[name] = list(dict.fromkeys([*drafter_ks.get(name, []), *own_ks]))
    drafters = list(drafter_ks)
    temps = [float(t) for t in args.temperatures.split(",")]
    verifiers = [v for v in args.verifiers.split(";") if v]
    parsed = {v: parse_verifier(v) for v in verifiers}
    # --acceptance-impl applies to the lossless rows (ASD has no kernel path).
    parsed = {v: with_acceptance_impl(p, args.acceptance_impl) if isinstance(p, Lossless) else p
              for v, p in parsed.items()}
    configs = [(t, None, 0, "lossless") for t in temps]
    if ref_model is not None:
        configs += [(t, AR_FLOAT32, 0, "lossless") for t in temps]

    def supports(v: str, t: float) -> bool:  # ASD is greedy-only: skip it at T > 0
        try:
            parsed[v].check(jspec.Sampling(temperature=t))
        except JspecError:
            return False
        return True

    configs += [(t, d, k, v) for t in temps for d in drafters for k in drafter_ks[d]
                for v in verifiers if supports(v, t)]
    loaded = {d: jspec.load_drafter(d, target=model) for d in drafters}
    # --lengths: dynamic length policies (LibraSpec) for the drafters that support them
    # (block drafters that can draft more blocks), lossless verification.

    policies = {spec: parse_length(spec) for spec in filter(None, args.lengths.split(";"))}
    configs += [(t, d, spec, "lossless") for t in temps for d in drafters for spec in policies
                if is_block_drafter(loaded[d])]
    outputs: dict[tuple, list[list[int]]] = {}
    results: dict[tuple, dict[str, Any]] = {}
    bar = tqdm(total=len(configs) * args.repeats * len(enc), desc="bench", unit="prompt",
               disable=tqdm is None or args.quiet) if tqdm else None
    # Every configuration compiles first; then each prompt is decoded by every configuration in
    # turn (the order rotating from prompt to prompt), so the ratios between rows come from
    # calls seconds apart, not from passes minutes apart on a host whose speed drifts.
    call_kw: dict[tuple, tuple[Any, dict[str, Any]]] = {}
    for cfg in configs:
        temp, dname, k, vname = cfg
        kw: dict[str, Any] = dict(max_new_tokens=args.new_tokens,
                                  sampling=jspec.Sampling(temperature=temp))
        run_model = ref_model if dname == AR_FLOAT32 else model
        if dname not in (None, AR_FLOAT32):
            length = policies[k] if isinstance(k, str) else jspec.FixedLength(k)
            verifier = parsed[vname] if vname in parsed else Lossless()
            kw.update(drafter=loaded[dname], length=length, verifier=verifier)
        call_kw[cfg] = (run_model, kw)
        results[cfg] = {"tps": [], "stats": None, "by_set": {p: {"tps": []} for p in sets}}
        jax.block_until_ready(jspec.generate(run_model, padded[:1], lengths[:1],
                                             key=jax.random.key(0), **kw).tokens)
    for rep in range(args.repeats):
        # per configuration: tokens, seconds, summed stats, per set [tokens, seconds, rounds,
        # emitted]
        acc: dict[tuple, list[Any]] = {cfg: [0, 0.0, None, {p: [0, 0.0, 0, 0] for p in sets}]
                                       for cfg in configs}
        for i in range(len(enc)):
            for j in range(len(configs)):
                cfg = configs[(i + j) % len(configs)]
                run_model, kw = call_kw[cfg]
                a = acc[cfg]
                key = jax.random.key(1000 * rep + i)
                t0 = time.perf_counter()
                out = jspec.generate(run_model, padded[i:i + 1], lengths[i:i + 1], key=key,
                                     **kw)
                n = int(out.lengths[0])
                dt = time.perf_counter() - t0
                a[0] += n
                a[1] += dt
                st = jax.device_get(out.stats)
                ps = a[3][set_of[i]]
                ps[0] += n
                ps[1] += dt
                ps[2] += int(st.rounds[0])
                ps[3] += int(st.emitted[0])
                if rep == 0:
                    outputs.setdefault(cfg, []).append(
                        [int(t) for t in np.asarray(out.tokens[0, :n])])
                vs = jax.device_get(out.verifier)
                # DIVERSED's running total variation to the target (its state declares it).
                tv = ((float(vs.tv_sum[0]), int(vs.positions[0]))
                      if isinstance(vs, DiversedState) else (0.0, 0))
                vec = [int(st.rounds[0]), int(st.emitted[0]), int(st.accepted[0]),
                       int(st.drafted[0]), int(st.oracle[0]), int(st.oracle_gap[0]), *tv,
                       *map(int, st.accepted_at[0])]
                a[2] = vec if a[2] is None else [x + y for x, y in zip(a[2], vec, strict=True)]
                if bar:
                    bar.update(1)
        for cfg, (tot_tokens, tot_time, agg, per_set) in acc.items():
            res = results[cfg]
            res["tps"].append(tot_tokens / tot_time)
            for p, (n_tok, secs, n_rounds, n_emit) in per_set.items():
                res["by_set"][p]["tps"].append(n_tok / secs)
                if rep == 0:
                    res["by_set"][p].update(tau=n_emit / max(n_rounds, 1), tokens=n_tok)
            if rep == 0:
                res["stats"] = agg
                res["tokens"] = tot_tokens
    if bar:
        bar.close()
    cost = cost_curve(model, (1, 8), args.fill, 5)
    ar_best = {t: max(statistics.median(results[(t, d, 0, "lossless")]["tps"])
                      for d in (None, AR_FLOAT32) if (t, d, 0, "lossless") in results)
               for t in temps}
    ar_best_set = {(t, p): max(statistics.median(results[(t, d, 0, "lossless")]["by_set"][p]["tps"])
                               for d in (None, AR_FLOAT32) if (t, d, 0, "lossless") in results)
                   for t in temps for p in sets}
    tree_c = {f"{d}@{k}": tree_cost(model, loaded[d], k, args.fill)  # c of a tree forward
              for d in drafters if loaded[d].caps.tree for k in drafter_ks[d]}
    hf_rows = _hf_speculative_rows(args, model, enc, drafters) if 0.0 in temps else []
    out_rows = []
    table = []
    quality = _quality(model, enc, rows, outputs, args) if args.quality else {}
    for (temp, dname, k, vname), res in results.items():
        tps = statistics.median(res["tps"])
        ar = statistics.median(results[(temp, None, 0, "lossless")]["tps"])
        rounds, emitted, accepted, drafted, oracle, gap, tv_sum, tv_n, *acc = res["stats"]
        spec = dname not in (None, AR_FLOAT32)
        dynamic = isinstance(k, str) or (spec and vname == "lossless"
                                         and not loaded[dname].caps.tree)
        row = {"temperature": temp, "drafter": dname or "autoregressive", "k": k,
               "verifier": vname, "dtype": "float32" if dname == AR_FLOAT32 else args.dtype,
               "tokens_per_s": tps, "speedup": tps / ar,
               "speedup_over_best_ar": tps / ar_best[temp],
               "tau": emitted / max(rounds, 1),
               "acceptance_rate": accepted / drafted if drafted else None,
               "tv_per_token": tv_sum / tv_n if tv_n else (0.0 if spec else None),
               "accept_by_position": [a / max(rounds, 1) for a in acc],
               "mean_length": drafted / max(rounds, 1) if spec else None,
               "oracle": oracle / max(rounds, 1) if dynamic else None,
               "oracle_gap": gap / max(rounds, 1) if dynamic else None,
               "new_tokens": res["tokens"], **quality.get((temp, dname, k, vname), {})}
        row["by_set"] = {p: {"tokens_per_s": statistics.median(b["tps"]),
                             "speedup_over_best_ar":
                                 statistics.median(b["tps"]) / ar_best_set[(temp, p)],
                             "tau": b["tau"] if spec else 1.0, "new_tokens": b["tokens"]}
                         for p, b in res["by_set"].items()}
        out_rows.append(row)
        q = quality.get((temp, dname, k, vname), {})
        ar_rate = row["acceptance_rate"]
        table.append([f"{temp:g}", row["drafter"], k or "-",
                      f"{row['mean_length']:.2f}" if spec else "-",
                      f"{row['oracle_gap']:.2f}" if row["oracle_gap"] is not None else "-",
                      vname, f"{tps:.1f}",
                      f"{row['speedup']:.2f}x", f"{row['speedup_over_best_ar']:.2f}x",
                      f"{row['tau']:.2f}" if spec else "1.00",
                      f"{ar_rate:.3f}" if ar_rate is not None else "-",
                      " ".join(f"{a:.2f}" for a in row["accept_by_position"]) or "-",
                      f"{q['changed']:.2f}" if "changed" in q else "-",
                      f"{q['nll']:.3f}" if "nll" in q else "-",
                      f"{row['tv_per_token']:.3f}" if spec and row["tv_per_token"] is not None
                      else "-",
                      f"{q['score']:.2f}" if "score" in q else "-"])
    ar0 = statistics.median(results[(0.0, None, 0, "lossless")]["tps"]) if 0.0 in temps else None
    for label, tps in hf_rows:
        out_rows.append({"temperature": 0.0, "drafter": label, "k": None, "tokens_per_s": tps,
                         "speedup": tps / ar0})
        table.append(["0", label, "-", "-", "-", "-", f"{tps:.1f}", f"{tps / ar0:.2f}x",
                      f"{tps / ar_best[0.0]:.2f}x", "-", "-", "-", "-", "-", "-", "-"])
    print_table(f"Speculative decoding on {args.prompts} ({len(enc)} prompts, batch 1, "
                 f"target {args.dtype}, "
                 f"{args.new_tokens} new tokens, median of {args.repeats} sweeps, each prompt's "
                 f"configurations back to back); "
                 f"rho_8 = t(8)/t(1) = {cost['c'][8]:.2f}"
                 + "".join(f"; {n}: tree of {c['nodes']} nodes, c = t(tree)/t(1) = {c['c']:.2f}"
                           for n, c in tree_c.items()),
                 ["T", "drafter", "K", "mean d", "|d-oracle|", "verifier", "tokens/s",
                  "speedup", "vs best AR", "tau", "accept",
                  "acceptance by position", "changed", "NLL/token", "TV/token", "score"], table)
    if len(sets) > 1:
        print_table("By prompt set (the rows above, split; speedup against the fastest "
                    "autoregressive row on the same set)",
                    ["T", "drafter", "K", "verifier",
                     *[f"{p}: {c}" for p in sets for c in ("tokens/s", "vs best AR", "tau")]],
                    [[f"{r['temperature']:g}", r["drafter"], r["k"] or "-", r["verifier"],
                      *[v for p in sets for v in (
                          f"{r['by_set'][p]['tokens_per_s']:.1f}",
                          f"{r['by_set'][p]['speedup_over_best_ar']:.2f}x",
                          f"{r['by_set'][p]['tau']:.2f}")]]
                     for r in out_rows if "by_set" in r])
    return {"prompts": args.prompts, "dtype": args.dtype, "rows": out_rows, "rho_8": cost["c"][8],
            "cost": cost, "tree_c": tree_c, "new_tokens": args.new_tokens,
            "repeats": args.repeats}


def _quality(model: Any, enc: list[list[int]], rows: list[dict[str, Any]],
             outputs: dict[tuple, list[list[int]]], args: argparse.Namespace
             ) -> dict[tuple, dict[str, float]]:
    """Per configuration: mean target NLL per generated token (the target scoring the output at
    temperature 1), the task score (HumanEval pass@1 / exact answer, `jspec.tasks`), and at T=0
    the fraction of outputs that differ from autoregressive greedy."""

    cfg = model.config
    width = bucket_length(max(len(e) for e in enc) + args.new_tokens)

    @jax.jit
    def logprobs(w, toks):
        cache = KVCache.create(cfg, 1, width)
        out = forward(cfg, w, toks, jnp.arange(width, dtype=jnp.int32)[None], cache)
        lp = jax.nn.log_softmax(out.logits[0, :-1], axis=-1)
        return jnp.take_along_axis(lp, toks[0, 1:, None], axis=-1)[:, 0]

    ref = outputs.get((0.0, None, 0, "lossless"))
    res: dict[tuple, dict[str, float]] = {}
    for key, outs in outputs.items():
        nll, count, passed = 0.0, 0, []
        for i, (prompt, new) in enumerate(zip(enc, outs, strict=True)):
            seq = np.zeros((1, width), np.int32)
            seq[0, : len(prompt) + len(new)] = prompt + new
            lp = np.asarray(logprobs(model.weights, jnp.asarray(seq)))
            nll -= float(lp[len(prompt) - 1: len(prompt) - 1 + len(new)].sum())
            count += len(new)
            sc = score(rows[i], model.decode(new))
            if sc is not None:
                passed.append(sc)
        q = {"nll": nll / max(count, 1)}
        if ref is not None and key[0] == 0.0:
            q["changed"] = float(np.mean([a != b for a, b in zip(outs, ref, strict=True)]))
        if passed:
            q["score"] = float(np.mean(passed))
        res[key] = q
    return res


def _hf_speculative_rows(args: argparse.Namespace, model: Any, enc: list[list[int]],
                         drafters: list[str]) -> list[tuple[str, float]]:
    """HF transformers on the same weights and prompts, greedy: plain and assisted generation.

    Speedups in the table are relative to jspec's autoregressive row of the same run.
    """

    if args.no_peer or not peer.hf_available() or args.model not in registry.REGISTRY:
        return []
    hf_dir = str(registry.converted_dir(registry.REGISTRY[args.model]))
    modes: list[tuple[str, str | None]] = [("HF greedy", None), ("HF prompt lookup", "prompt_lookup")]
    modes += [(f"HF assistant_early_exit={d.split(':')[1]}", f"early_exit:{d.split(':')[1]}")
              for d in drafters if d.startswith("early-exit:")]
    rows = []
    for label, mode in modes:
        tokens, secs = 0, 0.0
        for ids in enc:
            if mode is None:
                r = peer.hf_decode_tps(hf_dir, ids, args.new_tokens, "float32", 1)
            else:
                r = peer.hf_assisted_tps(hf_dir, ids, args.new_tokens, mode, 1)
            tokens += r["new_tokens"]
            secs += r["seconds"]
        rows.append((label, tokens / secs))
    return rows


def main(args: argparse.Namespace) -> int:

    if not args.baseline and not args.drafters and not args.batch_sizes:
        raise JspecError("nothing to measure: pass --baseline, --drafters and/or --batch-sizes")
    res: dict[str, Any] = {}
    if args.batch_sizes:
        res["batched"] = bench_batch.run(args)
    if args.baseline:
        res["baseline"] = baseline(args)
    if args.drafters and not args.batch_sizes:  # with --batch-sizes: the batched table's rows
        res["speculative"] = speculative(args)
    res["provenance"] = provenance(dtype=getattr(args, "dtype", None))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(res, indent=1, default=float))
    if getattr(args, "plot", None):
        from jspec.plot import plot_bench  # noqa: PLC0415 (matplotlib, optional)

        print(f"wrote {plot_bench(json.loads(json.dumps(res, default=float)), args.plot)}")
    return 0
