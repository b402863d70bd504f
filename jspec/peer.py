"""Peer baselines: Hugging Face transformers (PyTorch) timings for the benchmark.

Needs the `peer` extra (torch). torch is imported lazily, so `import jspec.peer` works without it;
call `hf_available()` first. Every function returns a plain dict of numbers and settings.
Timings use `time.perf_counter`, run under `torch.inference_mode()` with `torch.set_num_threads`
set to `threads` (default `THREADS` = 2), exclude one warm-up run, and report medians over
`repeats`. On a CPU shared with other work, use fewer threads than free cores: with every core
busy, a 2-thread float32 torch decode was measured ~10x slower than a 1-thread one (OpenMP
threads wait on each other at every op).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import inspect
import os
import statistics
import time
from typing import Any

THREADS = 2
DTYPES = ("float32", "bfloat16", "float16")
ASSISTED_MODES = ("self", "prompt_lookup")
PROMPT_LOOKUP_TOKENS = 10


def hf_available() -> bool:
    """True when both torch and transformers can be imported (without importing them)."""
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def setup_torch(threads: int = THREADS) -> Any:
    import torch  # noqa: PLC0415

    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    return torch


def _versions() -> dict[str, str]:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def _torch_dtype(dtype: str) -> Any:
    import torch  # noqa: PLC0415

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return getattr(torch, dtype)


@functools.lru_cache(maxsize=4)
def load_hf(hf_dir: str, dtype: str) -> Any:
    """The HF causal LM in eval mode (cached per directory and dtype)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=_torch_dtype(dtype))
    return model.eval()


def _prompt(prompt_ids: list[int]) -> tuple[Any, Any]:
    import torch  # noqa: PLC0415

    if not prompt_ids:
        raise ValueError("the prompt is empty")
    ids = torch.tensor([list(map(int, prompt_ids))], dtype=torch.long)
    return ids, torch.ones_like(ids)


def greedy_kwargs(model: Any, new_tokens: int) -> dict[str, Any]:
    """generate() kwargs for exactly `new_tokens` greedy tokens (EOS suppressed until then)."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    return {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
            "temperature": None, "top_p": None, "top_k": None, "pad_token_id": pad}


def _timed(fn: Any, repeats: int) -> tuple[list[float], Any]:
    """Run `fn` once as warm-up, then `repeats` timed times; (seconds per run, last result)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def hf_decode_tps(hf_dir: str | os.PathLike, prompt_ids: list[int], new_tokens: int,
                  dtype: str = "float32", repeats: int = 3, *, threads: int = THREADS
                  ) -> dict[str, Any]:
    """Plain greedy `generate` throughput of the HF model.

    Each run generates exactly `new_tokens` tokens (`min_new_tokens = max_new_tokens`). The
    prefill cost is measured separately (a 1-token `generate`) so that decode-only tokens/s can be
    reported alongside end-to-end tokens/s.

    Args:
      hf_dir: Hugging Face model directory.
      prompt_ids: the prompt's token ids (batch 1).
      new_tokens: tokens to generate per run.
      dtype: "float32", "bfloat16" or "float16".
      repeats: timed runs (after one warm-up run).
      threads: torch intra-op threads.
    Returns:
      dict with `tokens_per_s` (end-to-end, median), `decode_tokens_per_s` ((new_tokens - 1) /
      (median total - median prefill)), `seconds` (median total), `prefill_seconds`, per-run
      `seconds_all`, the generated `tokens`, and the settings.
    """
    torch = setup_torch(threads)
    model = load_hf(str(hf_dir), dtype)
    ids, mask = _prompt(prompt_ids)
    kwargs = greedy_kwargs(model, new_tokens)
    with torch.inference_mode():
        times, out = _timed(lambda: model.generate(ids, attention_mask=mask, **kwargs), repeats)
        pre_kwargs = {**kwargs, "max_new_tokens": 1, "min_new_tokens": 1}
        pre_times, _ = _timed(lambda: model.generate(ids, attention_mask=mask, **pre_kwargs),
                              repeats)
    new = out[0, ids.shape[1]:].tolist()
    total = statistics.median(times)
    prefill = statistics.median(pre_times)
    decode = total - prefill
    return {
        "engine": "hf", "mode": "greedy", "dtype": dtype, "threads": threads,
        "prompt_tokens": len(prompt_ids), "new_tokens": len(new), "repeats": repeats,
        "seconds": total, "seconds_all": times, "prefill_seconds": prefill,
        "tokens_per_s": len(new) / total,
        "decode_tokens_per_s": (len(new) - 1) / decode if decode > 0 and len(new) > 1 else None,
        "tokens": new, **_versions(),
    }


def hf_cost_curve(hf_dir: str | os.PathLike, ks: tuple[int, ...] = (1, 2, 4, 8, 16), fill: int = 400,
                  dtype: str = "float32", repeats: int = 5, *, threads: int = THREADS
                  ) -> dict[str, Any]:
    """Relative cost of one HF forward over K new tokens with `fill` tokens already cached.

    The cache is prefilled once (a `DynamicCache` over `fill` deterministic token ids); every
    timed forward appends K tokens and the cache is cropped back to `fill` outside the timed
    region. Only the forward itself is timed; the K values take turns within each repeat.

    Args:
      hf_dir: Hugging Face model directory.
      ks: numbers of new tokens per forward; 1 is always measured (the denominator).
      fill: tokens already in the KV cache.
      dtype: "float32", "bfloat16" or "float16".
      repeats: timed forwards per K (after one warm-up forward).
      threads: torch intra-op threads.
    Returns:
      dict with `seconds` {K: median seconds}, `ratio` {K: t(K) / t(1)}, and the settings.
    """
    torch = setup_torch(threads)
    from transformers import DynamicCache  # noqa: PLC0415

    if fill < 1:
        raise ValueError(f"fill must be >= 1, got {fill}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    model = load_hf(str(hf_dir), dtype)
    vocab = model.config.vocab_size
    ks = tuple(sorted({1, *(int(k) for k in ks)}))
    # deterministic, non-special filler tokens
    prefix = (torch.arange(fill, dtype=torch.long) * 7919 % (vocab - 1000) + 1000)[None]
    times: dict[int, list[float]] = {k: [] for k in ks}
    # transformers 5.x renamed `past_key_values` to `cache` (the old name is deprecated)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(prefix, use_cache=True, **{cache_kw: cache})
        if cache.get_seq_length() != fill:
            raise RuntimeError(f"prefill left {cache.get_seq_length()} cached tokens, not {fill}")
        # K values are interleaved within each repeat so that drifting machine load hits all alike
        for r in range(repeats + 1):  # repeat 0 is the warm-up
            for k in ks:
                new = (torch.arange(k, dtype=torch.long) * 31 % (vocab - 1000) + 1000)[None]
                positions = torch.arange(fill, fill + k, dtype=torch.long)[None]
                t0 = time.perf_counter()
                model(new, use_cache=True, position_ids=positions, logits_to_keep=k,
                      **{cache_kw: cache})
                dt = time.perf_counter() - t0
                cache.crop(-k)  # negative: remove k tokens (transformers 4.x and 5.x alike)
                if cache.get_seq_length() != fill:
                    raise RuntimeError(f"cache holds {cache.get_seq_length()} tokens after crop")
                if r:
                    times[k].append(dt)
    seconds = {k: statistics.median(v) for k, v in times.items()}
    return {
        "engine": "hf", "dtype": dtype, "threads": threads, "fill": fill, "repeats": repeats,
        "seconds": seconds, "ratio": {k: seconds[k] / seconds[1] for k in ks}, **_versions(),
    }


def hf_assisted_tps(hf_dir: str | os.PathLike, prompt_ids: list[int], new_tokens: int,
                    mode: str = "prompt_lookup", repeats: int = 3, dtype: str = "float32", *,
                    threads: int = THREADS) -> dict[str, Any]:
    """Greedy HF assisted generation throughput.

    Modes: "self" uses a second copy of the same model as `assistant_model` (every draft is
    accepted, so this measures the speculative machinery's overhead); "prompt_lookup" uses
    `prompt_lookup_num_tokens=10` (n-gram drafts from the prompt); "early_exit:N" uses
    `assistant_early_exit=N` (the model's first N layers draft). HF's assistant-length
    heuristic is reset before every run so repeats are independent.

    Args:
      hf_dir: Hugging Face model directory.
      prompt_ids: the prompt's token ids (batch 1).
      new_tokens: tokens to generate per run (`min_new_tokens = max_new_tokens`).
      mode: "self" or "prompt_lookup".
      repeats: timed runs (after one warm-up run).
      dtype: "float32", "bfloat16" or "float16".
      threads: torch intra-op threads.
    Returns:
      dict with `tokens_per_s` (end-to-end, median), `seconds` (median), per-run `seconds_all`,
      `matches_greedy` (output equals plain greedy `generate`), the tokens and the settings.
    """
    torch = setup_torch(threads)
    if mode not in ASSISTED_MODES and not mode.startswith("early_exit:"):
        raise ValueError(f"mode must be one of {ASSISTED_MODES} or early_exit:N, got {mode!r}")
    model = load_hf(str(hf_dir), dtype)
    ids, mask = _prompt(prompt_ids)
    kwargs = greedy_kwargs(model, new_tokens)
    assistant = None
    if mode == "self":
        from transformers import AutoModelForCausalLM  # noqa: PLC0415

        assistant = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=_torch_dtype(dtype)).eval()
        extra: dict[str, Any] = {"assistant_model": assistant}
    elif mode.startswith("early_exit:"):
        # HF's self-speculative mode: the first N layers + the LM head draft (like early-exit:N).
        extra = {"assistant_early_exit": int(mode.split(":", 1)[1])}
    else:
        extra = {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}
    initial = copy.deepcopy(assistant.generation_config) if assistant is not None else None

    def run() -> Any:
        if assistant is not None:
            assistant.generation_config = copy.deepcopy(initial)
        return model.generate(ids, attention_mask=mask, **kwargs, **extra)

    with torch.inference_mode():
        times, out = _timed(run, repeats)
        greedy = model.generate(ids, attention_mask=mask, **kwargs)
    new = out[0, ids.shape[1]:].tolist()
    total = statistics.median(times)
    return {
        "engine": "hf", "mode": f"assisted_{mode}", "dtype": dtype, "threads": threads,
        "prompt_tokens": len(prompt_ids), "new_tokens": len(new), "repeats": repeats,
        "seconds": total, "seconds_all": times, "tokens_per_s": len(new) / total,
        "matches_greedy": new == greedy[0, ids.shape[1]:].tolist(),
        "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS if mode == "prompt_lookup" else None,
        "tokens": new, **_versions(),
    }
