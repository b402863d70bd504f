"""Build tests/fixtures/smollm2_reference.json: Hugging Face transformers outputs for SmolLM2-135M.

Needs the `peer` extra (torch). Run from the repository root:

    python scripts/make_reference.py

It loads the float32 Hugging Face directory that `jspec.load_model("smollm2-135m")` converts into,
runs 4 chat prompts through `transformers` (prompt argmax at every position, top-20 logits at the
last prompt position, a 32-token greedy continuation with the top-2 logit gap at every step), and
writes a compact JSON fixture. It also checks jspec's float32 prompt logits against the HF logits
over all positions and the whole vocabulary (max abs diff <= 1e-3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

import jspec
from jspec.models.cache import KVCache
from jspec.models.llama import forward
from jspec.models.registry import REGISTRY, converted_dir

PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "List three primary colors.",
    "Explain photosynthesis in one sentence.",
)
TOP_K = 20
NEW_TOKENS = 32
TOLERANCE = 1e-3
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "smollm2_reference.json"


def jspec_prompt_logits(model: jspec.Model, ids: list[int]) -> np.ndarray:
    """jspec float32 logits f32[T, V] for one prompt, from a single full-prompt forward."""
    t = len(ids)
    cache = KVCache.create(model.config, 1, t)
    tokens = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    out = forward(model.config, model.weights, tokens, positions, cache)
    return np.asarray(out.logits[0], np.float32)


def hf_prompt_logits(hf: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """HF float32 logits f32[T, V] for one prompt."""
    with torch.inference_mode():
        out = hf(torch.tensor([ids], dtype=torch.long))
    return out.logits[0].float().numpy()


def hf_greedy(hf: torch.nn.Module, ids: list[int], eos_ids: list[int]) -> tuple[list[int], list[float]]:
    """HF greedy continuation (up to NEW_TOKENS, stops at EOS) and the top-2 logit gap per step."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids], dtype=torch.long),
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos_ids,
                          pad_token_id=eos_ids[0], output_logits=True, return_dict_in_generate=True,
                          temperature=None, top_p=None, top_k=None)
    new = [int(i) for i in out.sequences[0, len(ids):]]
    gaps = []
    for step_logits in out.logits[:len(new)]:
        top2 = torch.topk(step_logits[0].float(), 2).values
        gaps.append(round(float(top2[0] - top2[1]), 5))
    return new, gaps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-highest", action="store_true",
                        help="leave jax_default_matmul_precision at its default (diagnostics only)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if not args.no_highest:
        jax.config.update("jax_default_matmul_precision", "highest")
    torch.set_num_threads(2)

    model = jspec.load_model("smollm2-135m")
    hf_dir = converted_dir(REGISTRY["smollm2-135m"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    hf.eval()
    eos_ids = list(model.eos_ids)

    records = []
    worst = 0.0
    for text in PROMPTS:
        ids = model.encode(text, chat=True)
        hf_logits = hf_prompt_logits(hf, ids)
        js_logits = jspec_prompt_logits(model, ids)
        diff = float(np.max(np.abs(hf_logits - js_logits)))
        worst = max(worst, diff)
        last = hf_logits[-1]
        top_ids = np.argsort(-last, kind="stable")[:TOP_K]
        new, gaps = hf_greedy(hf, ids, eos_ids)
        print(f"{text!r}: {len(ids)} prompt tokens, max|jspec-hf| = {diff:.3g}, "
              f"min gap = {min(gaps):.3g}, continuation = {model.decode(new)!r}")
        records.append({
            "text": text,
            "prompt_ids": ids,
            "prompt_argmax": [int(i) for i in hf_logits.argmax(-1)],
            "last_top_ids": [int(i) for i in top_ids],
            "last_top_logits": [round(float(v), 6) for v in last[top_ids]],
            "greedy_ids": new,
            "greedy_top2_gap": gaps,
        })
    print(f"max abs diff over all prompts, positions, vocab: {worst:.3g} "
          f"(matmul precision {'default' if args.no_highest else 'highest'})")

    fixture = {
        "model": "smollm2-135m",
        "description": "HF transformers float32 reference for jspec (see scripts/make_reference.py)",
        "command": "python scripts/make_reference.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "top_k": TOP_K,
        "new_tokens": NEW_TOKENS,
        "eos_ids": eos_ids,
        "max_abs_diff_jspec_vs_hf": float(f"{worst:.3g}"),
        "prompts": records,
    }
    if not args.no_highest:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
        print(f"wrote {os.path.relpath(args.out)} ({args.out.stat().st_size} bytes)")
    assert worst <= TOLERANCE, f"jspec vs HF logits differ by {worst} > {TOLERANCE}"
    return 0


if __name__ == "__main__":
    sys.exit(main())
