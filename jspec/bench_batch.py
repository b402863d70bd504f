"""`python -m jspec bench --batch-sizes 1,4,16,64`: batched generation, jspec next to HF.

One protocol for every engine: the same prompts (default 64 held-out AlpacaEval instructions
through the chat template), split into consecutive batches of B, each batch decoding exactly
`new_tokens` greedy tokens per row (EOS ignored), prefill included. tokens/s = all new tokens /
the wall time of all batches; median over `repeats` (after a warm-up that compiles each
shape once).
jspec rows also report the peak device memory XLA plans for one batch (`memory_analysis` of the
compiled `generate`: arguments + outputs + temporaries, minus donated aliases); HF rows the
process's resident-memory growth is not comparable and is left out.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import jax.numpy as jnp
import numpy as np

from jspec import decode, peer
from jspec.drafters.loading import load_drafter
from jspec.errors import JspecError
from jspec.inputs import pad_to_bucket, right_pad
from jspec.length import FixedLength
from jspec.models import registry
from jspec.models.model import load_model
from jspec.prompts import load_prompt_set
from jspec.specs import split_list
from jspec.tables import print_table

DEFAULT_PROMPTS = "alpaca:0-64"  # held out of datagen's training split (train.datagen.SPLITS)


def _chunks(enc: list[list[int]], b: int) -> list[list[list[int]]]:
    return [enc[i:i + b] for i in range(0, len(enc), b)]


def jspec_batched(model: Any, enc: list[list[int]], batch: int, new_tokens: int,
                  repeats: int, drafter: Any = None, length: Any = None,
                  ignore_eos: bool = True) -> dict[str, Any]:
    """Greedy tokens/s of `jspec.generate` over `enc` in batches of `batch` (EOS ignored by
    default, so every row decodes `new_tokens`)."""
    if ignore_eos:
        model = dataclasses.replace(model, config=model.config.replace(eos_ids=()))
    batches = [right_pad(c) for c in _chunks(enc, batch)]  # lengths are given: any pad
    taus = []

    def one_pass() -> int:
        n = 0
        for ids, lens in batches:
            out = decode.generate(model, jnp.asarray(ids), jnp.asarray(lens), drafter=drafter,
                                  length=length, max_new_tokens=new_tokens)
            lengths = np.asarray(out.lengths)  # waits for the device
            n += int(lengths.sum())
            if drafter is not None:
                taus.append(float(np.mean(out.stats.mean_accepted())))
        return n

    seen = set()
    for ids, lens in batches:  # warm-up: compile each (bucket, batch) shape once
        shape = (pad_to_bucket(jnp.asarray(ids)).shape, len(lens))
        if shape not in seen:
            seen.add(shape)
            np.asarray(decode.generate(model, jnp.asarray(ids), jnp.asarray(lens),
                                       drafter=drafter, length=length,
                                       max_new_tokens=new_tokens).lengths)
    taus.clear()
    sec, times, n = _timed_passes(one_pass, repeats)
    ids, lens = batches[0]
    res = {"tokens_per_s": n / sec, "seconds": sec, "seconds_all": times, "new_tokens": n,
           "peak_bytes": compiled_peak_bytes(model, ids, lens, new_tokens, drafter, length)}
    if drafter is not None:
        res["tau"] = statistics.median(taus)
    return res


def _timed_passes(one_pass: Any, repeats: int) -> tuple[float, list[float], int]:
    """(median seconds, every pass's seconds, tokens of the last pass) over `repeats` passes."""
    times, n = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = one_pass()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, n


def compiled_peak_bytes(model: Any, ids: np.ndarray, lens: np.ndarray, new_tokens: int,
                        drafter: Any = None, length: Any = None) -> int | None:
    """Bytes XLA plans for the `generate` of this batch (ids i32[B, P], lens i32[B]) that
    `jspec_batched` times (None where the backend does not say)."""
    m = decode.lower(model, jnp.asarray(ids), jnp.asarray(lens), drafter=drafter, length=length,
                     max_new_tokens=new_tokens).compile().memory_analysis()
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def hf_batched(hf_dir: str, enc: list[list[int]], batch: int, new_tokens: int, dtype: str,
               repeats: int, pad_id: int) -> dict[str, Any]:
    """The same protocol with HF transformers `generate` (left padding, attention mask)."""
    torch = peer.setup_torch()
    model = peer.load_hf(hf_dir, dtype)
    kw = peer.greedy_kwargs(model, new_tokens)
    batches = []
    for c in _chunks(enc, batch):
        width = max(len(r) for r in c)
        ids = torch.full((len(c), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(c), width), dtype=torch.long)
        for i, r in enumerate(c):
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        batches.append((ids, mask))

    def one_pass() -> int:
        n = 0
        for ids, mask in batches:
            out = model.generate(ids, attention_mask=mask, **kw)
            n += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        return n

    with torch.inference_mode():
        model.generate(batches[0][0], attention_mask=batches[0][1], **kw)  # warm-up
        sec, times, n = _timed_passes(one_pass, repeats)
    return {"tokens_per_s": n / sec, "seconds": sec, "seconds_all": times, "new_tokens": n}


def run(args: Any) -> dict[str, Any]:
    """The `bench --batch-sizes` table (and its JSON)."""
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    except ValueError as e:
        raise JspecError(f"--batch-sizes takes comma-separated integers, got "
                         f"{args.batch_sizes!r}") from e
    if not sizes or min(sizes) < 1:
        raise JspecError(f"--batch-sizes needs positive integers, got {args.batch_sizes!r}")
    base = load_model(args.model)
    spec = args.prompts if args.prompts != "humaneval:8" else DEFAULT_PROMPTS
    enc = [base.encode(r["text"]) for r in load_prompt_set(spec)]
    dtypes = ("float32",) if args.no_bf16 else ("float32", "bfloat16")
    use_peer = not args.no_peer and peer.hf_available() and args.model in registry.REGISTRY
    res: dict[str, Any] = {"prompts": spec, "num_prompts": len(enc), "new_tokens": args.new_tokens,
                           "repeats": args.repeats, "batch_sizes": sizes, "rows": []}
    for b in sizes:
        for dt in dtypes:
            r = jspec_batched(base.astype(dt), enc, b, args.new_tokens, args.repeats)
            res["rows"].append({"engine": "jspec", "dtype": dt, "batch": b, **r})
            print(f"jspec {dt} batch {b}: {r['tokens_per_s']:.1f} tok/s", flush=True)
        if use_peer:
            hf_dir = str(registry.converted_dir(registry.REGISTRY[args.model]))
            for dt in dtypes:
                r = hf_batched(hf_dir, enc, b, args.new_tokens, dt, args.repeats, base.pad_id)
                res["rows"].append({"engine": "hf", "dtype": dt, "batch": b, **r})
                print(f"HF {dt} batch {b}: {r['tokens_per_s']:.1f} tok/s", flush=True)
    spec_rows = _speculative_rows(args, base, enc, sizes, res)
    rows = []
    for b in sizes:
        got = {(r["engine"], r["dtype"]): r for r in res["rows"]
               if r["batch"] == b and "drafter" not in r and r.get("ignore_eos", True)}
        cells = [b]
        for eng in ("jspec", "hf"):
            for dt in dtypes:
                r = got.get((eng, dt))
                cells.append(f"{r['tokens_per_s']:.1f}" if r else "-")
        best_j = max(got[("jspec", dt)]["tokens_per_s"] for dt in dtypes)
        hf_best = [got[("hf", dt)]["tokens_per_s"] for dt in dtypes if ("hf", dt) in got]
        cells.append(f"{best_j / max(hf_best):.2f}x" if hf_best else "-")
        peaks = [got[("jspec", dt)].get("peak_bytes") for dt in dtypes]
        cells.append(" / ".join(f"{p / 2**20:.0f}" if p else "?" for p in peaks))
        rows.append(cells)
    header = (["batch"] + [f"jspec {d}" for d in dtypes] + [f"HF {d}" for d in dtypes]
              + ["jspec best / HF best", "jspec peak MiB (" + "/".join(dtypes) + ")"])
    print_table(f"Batched greedy generation, tokens/s ({len(enc)} prompts of {spec}, "
                 f"{args.new_tokens} new tokens each, prefill included, median of "
                 f"{args.repeats})", header, rows)
    if spec_rows:
        print_table(f"Speculative decoding at batch B ({args.dtype} target, greedy, lossless, "
                    "EOS ends a row; speedup over autoregressive decoding at the same batch, "
                    "dtype and prompts)",
                    ["batch", "drafter", "K", "tokens/s", "tau", "vs AR"], spec_rows)
    return res


def _speculative_rows(args: Any, base: Any, enc: list[list[int]], sizes: list[int],
                      res: dict[str, Any]) -> list[list[Any]]:
    """--drafters with --batch-sizes: each drafter (name@K, first K) at every batch size,
    against autoregressive decoding of the same target, batch and prompts. Here EOS ends a row
    (after it a drafter would be asked to predict what the target writes past its answer):
    greedy output is identical, so both decode the same tokens."""
    specs = split_list(args.drafters)
    if not specs:
        return []
    model = base.astype(args.dtype)
    out = []
    ar = {}
    for b in sizes:
        r = jspec_batched(model, enc, b, args.new_tokens, args.repeats, ignore_eos=False)
        res["rows"].append({"engine": "jspec", "dtype": args.dtype, "batch": b,
                            "ignore_eos": False, **r})
        ar[b] = r["tokens_per_s"]
        print(f"jspec {args.dtype} batch {b} (EOS ends rows): {ar[b]:.1f} tok/s", flush=True)
        out.append([b, "none (autoregressive)", 0, f"{ar[b]:.1f}", "1.00", "1.00x"])
    for spec in specs:
        name, _, ks = spec.partition("@")
        k = int(ks.split("/")[0]) if ks else int(args.ks.split(",")[0])
        drafter = load_drafter(name, target=model)
        for b in sizes:
            r = jspec_batched(model, enc, b, args.new_tokens, args.repeats, drafter=drafter,
                              length=FixedLength(k), ignore_eos=False)
            res["rows"].append({"engine": "jspec", "dtype": args.dtype, "batch": b,
                                "drafter": name, "k": k, "ignore_eos": False, **r})
            print(f"jspec {args.dtype} batch {b} {name} K={k}: {r['tokens_per_s']:.1f} tok/s "
                  f"(tau {r['tau']:.2f})", flush=True)
            out.append([b, name, k, f"{r['tokens_per_s']:.1f}", f"{r['tau']:.2f}",
                        f"{r['tokens_per_s'] / ar[b]:.2f}x"])
    return out
