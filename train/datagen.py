"""`python -m train datagen`: the target's own responses, with its hidden states, in shards.

Prompts come from sets that ship inside packages (or are generated, seeded): see
`train.datagen.SPLITS`. Each prompt goes through the chat template; the target answers greedily
and by sampling (T=1). While it decodes, the hidden states of the feature layers are recorded from
the very forwards that produce the tokens (no second pass), so the features are exactly what the
drafter sees at inference time.

Why cached, not on-the-fly: both drafters train for several epochs over the same sequences, and a
target forward costs ~10x a drafter step on this CPU; the cache is bounded by the data size
(float16, 6 vectors of 576 per token: ~7 KB/token, ~2 GB for 300k tokens) and written once.
At scale (millions of tokens) the features are too big to keep with the code, so
`--tokens-only` writes token shards alone (compressed, no `feats`; any `--dtype`), which are
committed under train/corpus/, and `python -m train featurize` (train/featurize.py) computes
the features from them with one batched forward per shard.

Shard layout (`<out>/<set>-<mode>-<index>.npz`, written atomically, skipped when present, so a
killed run resumes where it stopped):
  tokens  i32[T_total]        prompt + response tokens of every row, concatenated
  offsets i64[R+1]            row r is tokens[offsets[r]:offsets[r+1]]
  prompt_lens i32[R]          prompt part of each row
  feats   f16[T_total, F, D]  hidden states of FEATURE_LAYERS, each divided by its RMS (late
                              layers reach |x| ~ 1e5, past float16's range; the drafters apply
                              the same parameter-free normalisation at inference), then the
                              final-normed state; for every position whose token was fed to the
                              target (all but each row's last token, whose slot is zero)

Backends: `jax` decodes with jspec itself; `torch` runs HF transformers on the same weights
(converted once from the GGUF); its tokens and features agree with the jax backend's
(tests/test_train.py, when torch is installed; layer L, HF's final-normed state, is refused).
`auto` (the default) times both on the first batch to do and keeps the faster (the
measurement is printed): HF was ~3.5x faster batched before jspec's batched decode step was
fixed (issue 18), so this is measured, not assumed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import jspec
from jspec.models.blocks import rms_normalize
from jspec.models.cache import KVCache
from jspec.models.config import ModelConfig
from jspec.models.llama import Weights, forward, lm_logits
from jspec.models.model import load_model
from jspec.models.registry import REGISTRY, converted_dir
from jspec.prompts import load_prompt_set
from jspec.sampling import Sampling, sample
from jspec.state import bucket_length, is_eos

# Hidden states recorded for the drafters: 5 layers spread over the 30 (DFlash uses all five,
# EAGLE-3 the low/mid/high ones 1, 14, 27), then the final-normed state (target logits for the
# soft loss are recomputed from it through the shared LM head).
FEATURE_LAYERS = (1, 7, 14, 20, 27)

# Held-out prompts are never generated from: the benchmarks and τ evaluation use them.
# name -> (loader spec of the held-out part, loader spec of the training part)
SPLITS = {
    "humaneval": ("humaneval:0-32", "humaneval:32-164"),
    "math": ("math:0-64", "math:64-364"),
    "gsm8k": ("gsm8k:0-20", "gsm8k:20-100"),
    "mtbench": ("mtbench:60-80", "mtbench:0-60"),
    "alpaca": ("alpaca:0-100", "alpaca:100-400"),
}
MODES = {"greedy": Sampling(), "sample": Sampling(temperature=1.0)}


def _torch_generate(hf: Any, prompts: list[list[int]], sampling: Sampling, max_new: int,
                    eos_id: int, seed: int, layers: tuple[int, ...] = FEATURE_LAYERS,
                    with_feats: bool = True) -> tuple[Any, ...]:
    """The torch backend of `generate_with_features` (same outputs, numpy; the two feature
    arrays are None when not `with_feats`)."""
    import torch  # noqa: PLC0415

    b = len(prompts)
    p = max(len(x) for x in prompts)
    ids = torch.full((b, p), eos_id, dtype=torch.long)
    mask = torch.zeros((b, p), dtype=torch.long)
    for r, x in enumerate(prompts):  # left padding: HF derives positions from the mask
        ids[r, p - len(x):] = torch.tensor(x)
        mask[r, p - len(x):] = 1
    torch.manual_seed(seed)
    kw = (dict(do_sample=False) if sampling.greedy else
          dict(do_sample=True, temperature=sampling.temperature, top_k=0, top_p=1.0))
    with torch.no_grad():
        g = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new,
                        output_hidden_states=with_feats, return_dict_in_generate=True,
                        pad_token_id=eos_id, eos_token_id=eos_id, **kw)
    hs = g.hidden_states  # steps x (L+1) x [B, T, D]; [L] is after the final norm (or None)

    def pick(step):  # [B, T, F, D]
        f = [hs[step][i].float().numpy() for i in layers]
        f = [x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) for x in f]
        f.append(hs[step][-1].float().numpy())
        return np.stack(f, axis=2).astype(np.float16)

    seqs = g.sequences[:, p:].numpy().astype(np.int32)
    n_steps = seqs.shape[1]
    toks = np.full((b, max_new), -1, np.int32)
    n = np.zeros((b,), np.int32)
    for r in range(b):
        row = seqs[r]
        eos = np.nonzero(row == eos_id)[0]
        n[r] = eos[0] + 1 if len(eos) else n_steps
        toks[r, : n[r]] = row[: n[r]]
    if not with_feats:
        return None, toks, n, None
    d = hs[0][0].shape[-1]
    pf0 = pick(0)
    pf = np.zeros((b, p, len(layers) + 1, d), np.float16)
    for r, x in enumerate(prompts):  # back to right padding
        pf[r, : len(x)] = pf0[r, p - len(x):]
    rf = np.zeros((b, max_new, len(layers) + 1, d), np.float16)
    for s in range(1, n_steps):
        rf[:, s - 1] = pick(s)[:, 0]
    return pf, toks, n, rf


def load_hf_target(model_name: str, dtype: str = "float32") -> Any:
    """HF transformers model on the same weights (jspec's converted directory)."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    path = converted_dir(REGISTRY[model_name]) if model_name in REGISTRY else model_name
    torch.set_num_threads(os.cpu_count() or 1)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()


@functools.partial(jax.jit, static_argnames=("config", "sampling", "max_new", "capacity",
                                             "layers", "eos_ids"))
def generate_with_features(weights: Weights, prompt_ids: jax.Array, prompt_lens: jax.Array,
                           key: jax.Array, *, config: ModelConfig, sampling: Sampling,
                           max_new: int, capacity: int, layers: tuple[int, ...],
                           eos_ids: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """Decode `max_new` tokens per row and record the features of every fed token.

    Args:
      prompt_ids: i32[B, P] right-padded; prompt_lens: i32[B].
    Returns:
      prompt_feats f16[B, P, F, D], resp_tokens i32[B, N] (-1 after the end),
      resp_len i32[B] (EOS included), resp_feats f16[B, N, F, D] (slot i: features of resp
      token i when it was fed; the last token of each row is never fed).
    """
    b, p = prompt_ids.shape
    cache = KVCache.create(config, b, capacity)
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    out = forward(config, weights, prompt_ids, pos, cache, hidden_layers=layers,
                  compute_logits=False)

    def feats(o):  # [n, B, T, D] + [B, T, D] -> [B, T, F, D]
        f = jnp.concatenate([rms_normalize(o.hidden), o.final_hidden[None]], axis=0)
        return jnp.moveaxis(f, 0, 2).astype(jnp.float16)

    prompt_feats = feats(out)
    last_h = jnp.take_along_axis(out.final_hidden, (prompt_lens - 1)[:, None, None], axis=1)
    key, sub = jax.random.split(key)
    first = sample(sub, lm_logits(config, weights, last_h[:, 0]), sampling)
    toks = jnp.full((b, max_new), -1, jnp.int32).at[:, 0].set(first)
    rfeats = jnp.zeros((b, max_new, len(layers) + 1, config.hidden_size), jnp.float16)
    done = is_eos(first, eos_ids)
    n = jnp.ones((b,), jnp.int32)
    cache = out.cache.with_lengths(prompt_lens)

    def cond(c):
        i, _, _, _, done, _, _ = c
        return (i < max_new - 1) & ~jnp.all(done)

    def body(c):
        i, cache, toks, rfeats, done, n, key = c
        tok = toks[:, i]
        o = forward(config, weights, tok[:, None], cache.lengths[:, None], cache,
                    hidden_layers=layers)
        rfeats = rfeats.at[:, i].set(feats(o)[:, 0])
        key, sub = jax.random.split(key)
        nxt = sample(sub, o.logits[:, 0], sampling)
        nxt = jnp.where(done, -1, nxt)
        toks = toks.at[:, i + 1].set(nxt)
        n = n + (~done).astype(jnp.int32)
        done = done | is_eos(nxt, eos_ids)
        return i + 1, o.cache.with_lengths(cache.lengths + 1), toks, rfeats, done, n, key

    _, _, toks, rfeats, _, n, _ = jax.lax.while_loop(
        cond, body, (jnp.int32(0), cache, toks, rfeats, done, n, key))
    return prompt_feats, toks, n, rfeats


@dataclasses.dataclass
class Shard:
    tokens: np.ndarray
    offsets: np.ndarray
    prompt_lens: np.ndarray
    feats: np.ndarray | None  # None in a token shard (`--tokens-only`; `train featurize`)


def _pack(prompts: list[list[int]], pf: np.ndarray | None, toks: np.ndarray, n: np.ndarray,
          rf: np.ndarray | None) -> Shard:
    all_t, all_f, offs, plens = [], [], [0], []
    for r, pr in enumerate(prompts):
        lp, nr = len(pr), int(n[r])
        t = np.concatenate([np.asarray(pr, np.int32), toks[r, :nr]])
        if pf is not None:
            all_f.append(np.concatenate([pf[r, :lp], rf[r, :nr]], axis=0))  # last: zeros
        all_t.append(t)
        offs.append(offs[-1] + len(t))
        plens.append(lp)
    return Shard(tokens=np.concatenate(all_t), offsets=np.asarray(offs, np.int64),
                 prompt_lens=np.asarray(plens, np.int32),
                 feats=np.concatenate(all_f) if pf is not None else None)


def save_shard(path: Path, shard: Shard) -> None:
    """Atomic write; a token shard (no features) is compressed: under a byte a token."""
    tmp = path.with_suffix(".tmp.npz")
    arrays = {k: v for k, v in dataclasses.asdict(shard).items() if v is not None}
    (np.savez if shard.feats is not None else np.savez_compressed)(tmp, **arrays)
    os.replace(tmp, path)


def load_shard(path: Path, mmap: bool = False) -> Shard:
    z = np.load(path, mmap_mode="r" if mmap else None)
    return Shard(**{k: z[k] for k in ("tokens", "offsets", "prompt_lens")},
                 feats=z["feats"] if "feats" in z.files else None)


def run(args: argparse.Namespace) -> int:


    if args.samples < 1:
        raise SystemExit(f"error: --samples must be >= 1, got {args.samples}")
    if args.dtype != "float32" and not args.tokens_only:
        raise SystemExit("error: --dtype bfloat16 needs --tokens-only (features are recorded in "
                         "float32; `train featurize` computes them from token shards)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model)
    layers = tuple(args.feature_layers) if args.feature_layers else FEATURE_LAYERS
    if not args.tokens_only and max(layers) > model.config.num_layers:
        raise SystemExit(f"error: feature layer {max(layers)} > the model's "
                         f"{model.config.num_layers} layers")
    meta = {"model": args.model, "feature_layers": None if args.tokens_only else list(layers),
            "max_new": args.max_new, "seed": args.seed, "splits": SPLITS,
            "hidden_size": model.config.hidden_size, "tokens_only": args.tokens_only,
            "dtype": args.dtype}
    meta_path = out / "meta.json"
    same = ("model", "feature_layers", "max_new", "tokens_only", "dtype")
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        old.setdefault("tokens_only", False)
        old.setdefault("dtype", "float32")
        if {k: old.get(k) for k in same} != {k: meta[k] for k in same}:
            meta_path = None
    if meta_path is None:
        raise SystemExit(f"error: {out} holds data made with other settings; use another --out")
    meta_path.write_text(json.dumps(meta, indent=1))

    jobs = []
    sources = [Path(args.prompts_file).stem] if args.prompts_file else args.sets
    for name in sources:
        if args.prompts_file:
            rows = [json.loads(x) for x in Path(args.prompts_file).read_text().splitlines()
                    if x.strip()]
        elif name not in SPLITS:
            raise SystemExit(f"error: unknown prompt set {name!r} (have {sorted(SPLITS)})")
        else:
            rows = load_prompt_set(SPLITS[name][0 if args.split == "heldout" else 1])
        if args.limit:
            rows = rows[: args.limit]
        enc = [model.encode(r["text"]) if model.tokenizer is not None else list(r["ids"])
               for r in rows]
        order = sorted(range(len(enc)), key=lambda i: len(enc[i]))  # similar lengths together
        for mode in args.modes:
            # "sample" shards keep their name; further T=1 samples are sample1, sample2, ...
            variants = [mode] if mode == "greedy" else [
                "sample" if i == 0 else f"sample{i}" for i in range(args.samples)]
            for variant in variants:
                for s in range(0, len(order), args.batch):
                    tag = name if args.split == "train" else f"heldout_{name}"
                    jobs.append((tag, variant, s // args.batch,
                                 [enc[i] for i in order[s:s + args.batch]]))
    todo = [j for j in jobs if not (out / f"{j[0]}-{j[1]}-{j[2]:04d}.npz").exists()]
    print(f"datagen: {len(jobs)} shards, {len(jobs) - len(todo)} already done -> {out}",
          flush=True)
    if not todo:
        return 0
    decode = _decoder(args, model, layers, todo[0][3])
    bar = tqdm(todo, unit="shard", dynamic_ncols=True)
    n_tok, t0 = 0, time.perf_counter()
    for name, variant, idx, prompts in bar:
        tag = sum(ord(ch) for ch in f"{name}-{variant}")  # stable across processes (not hash())
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(args.seed), idx), tag)
        mode = "greedy" if variant == "greedy" else "sample"
        pf, toks, n, rf = decode(prompts, mode, key, args.max_new)
        shard = _pack(prompts, pf, toks, n[: len(prompts)], rf)
        save_shard(out / f"{name}-{variant}-{idx:04d}.npz", shard)
        n_tok += int(n[: len(prompts)].sum())
        rate = n_tok / (time.perf_counter() - t0)
        bar.set_postfix(resp_tok_s=f"{rate:.0f}", resp_tok=n_tok)
    print(f"datagen: done, {n_tok} response tokens this run", flush=True)
    return 0


def _decoder(args: argparse.Namespace, model: Any, layers: tuple[int, ...],
             probe: list[list[int]]) -> Any:
    """`(prompts, mode, key, max_new) -> (prompt_feats, toks, n, resp_feats)` numpy (the
    features None with `--tokens-only`), on the backend asked for; "auto" times both on `probe`
    (the first batch to do, 32 greedy tokens, jax's compile excluded) and takes the faster when
    torch is installed."""
    b = args.batch
    feats = not args.tokens_only
    target = model if args.dtype == "float32" else load_model(args.model, dtype=args.dtype)

    def jax_decode(prompts, mode, key, max_new):
        width = bucket_length(max(len(p) for p in prompts))
        ids = np.zeros((b, width), np.int32)
        lens = np.ones((b,), np.int32)
        for r, pr in enumerate(prompts):
            ids[r, : len(pr)] = pr
            lens[r] = len(pr)
        if not feats:  # plain batched decoding: jspec's fast path
            res = jspec.generate(target, jnp.asarray(ids), jnp.asarray(lens),
                                 max_new_tokens=max_new, sampling=MODES[mode], key=key)
            return None, np.asarray(res.tokens), np.asarray(res.lengths), None
        cap = -(-(width + max_new + 1) // 128) * 128
        res = generate_with_features(
            model.weights, jnp.asarray(ids), jnp.asarray(lens), key, config=model.config,
            sampling=MODES[mode], max_new=max_new, capacity=cap, layers=layers,
            eos_ids=model.eos_ids)
        return tuple(np.asarray(x) for x in res)

    backend = args.backend
    if feats and max(layers) >= model.config.num_layers:  # HF: hidden_states[L] is normed
        if backend == "torch":
            raise SystemExit(f"error: the torch backend cannot record layer {max(layers)} (HF's "
                             "last hidden state is after the final norm); use --backend jax")
        backend = "jax"
    if backend == "jax":
        return jax_decode
    if backend == "auto" and not importlib.util.find_spec("torch"):
        print("datagen: backend jax (torch is not installed)", flush=True)
        return jax_decode
    hf = load_hf_target(args.model, args.dtype)

    def torch_decode(prompts, mode, key, max_new):
        seed = int(jax.random.randint(key, (), 0, 2**31 - 1))
        return _torch_generate(hf, prompts, MODES[mode], max_new, model.eos_ids[0], seed,
                               layers, with_feats=feats)

    if backend == "torch":
        return torch_decode
    probe_new = min(32, args.max_new)
    rates = {}
    for name, fn in (("jax", jax_decode), ("torch", torch_decode)):
        fn(probe, "greedy", jax.random.key(0), probe_new)  # warm-up (jax: compile)
        t0 = time.perf_counter()
        n = fn(probe, "greedy", jax.random.key(0), probe_new)[2]
        rates[name] = float(np.sum(n[: len(probe)])) / (time.perf_counter() - t0)
    pick = max(rates, key=rates.get)
    print(f"datagen: backend {pick} (measured on the first batch: jax {rates['jax']:.0f}, "
          f"torch {rates['torch']:.0f} response tokens/s)", flush=True)
    return jax_decode if pick == "jax" else torch_decode


def add_parser(sub: Any) -> None:
    p = sub.add_parser("datagen", help="generate training data: the target's own responses "
                       "with its hidden states, in resumable shards")
    p.add_argument("--model", default="smollm2-135m", help="target model (registry name or dir)")
    p.add_argument("--out", default="runs/data", help="shard directory (default runs/data)")
    p.add_argument("--sets", nargs="+", default=list(SPLITS),
                   help=f"prompt sets, training split only (default: all of {list(SPLITS)})")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                   help="greedy and/or sampled (T=1) responses (default both)")
    p.add_argument("--max-new", type=int, default=256, help="response tokens per prompt")
    p.add_argument("--samples", type=int, default=1,
                   help="T=1 responses per prompt for the 'sample' mode (default 1; shards "
                        "sample, sample1, sample2, ...)")
    p.add_argument("--batch", type=int, default=16, help="prompts decoded together")
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts per set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--feature-layers", type=int, nargs="+", default=None,
                   help=f"target layers to record (default {list(FEATURE_LAYERS)}: five spread "
                   "over SmolLM2's 30; EAGLE-3 uses the first, middle and last)")
    p.add_argument("--prompts-file", default=None,
                   help="JSONL with a 'text' field per line: use these prompts instead of --sets "
                   "(named by the file stem)")
    p.add_argument("--split", choices=("train", "heldout"), default="train",
                   help="which part of each prompt set (held-out shards are named heldout_*; "
                   "training never reads them, evaluation only reads them)")
    p.add_argument("--backend", choices=("auto", "torch", "jax"), default="auto",
                   help="who decodes: jax (jspec), torch (HF transformers on the same weights), "
                   "or auto (default: time both on the first batch and use the faster; jax when "
                   "torch is not installed)")
    p.add_argument("--tokens-only", action="store_true",
                   help="store token shards only (compressed, under a byte a token: small enough "
                   "to commit, e.g. under train/corpus/); `python -m train featurize` turns them "
                   "into the feature shards training reads")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="target dtype while decoding (bfloat16 only with --tokens-only; default "
                   "float32)")
    p.set_defaults(func=run)
