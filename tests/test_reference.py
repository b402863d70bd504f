"""jspec vs Hugging Face transformers on SmolLM2-135M (fixture from scripts/make_reference.py).

No torch here: the HF numbers live in tests/fixtures/smollm2_reference.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.models.cache import KVCache
from jspec.models.llama import forward

pytestmark = pytest.mark.real

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_reference.json"
LOGIT_TOL = 1e-3
NEAR_TIE = 0.05  # HF top-2 logit gap below which the greedy choice is not reproducible
MIN_COMPARED = 8


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(FIXTURE.read_text())


def test_fixture_prompts_match_tokenizer(real_model, reference):
    for rec in reference["prompts"]:
        assert real_model.encode(rec["text"], chat=True) == rec["prompt_ids"], rec["text"]


def test_prompt_logits_match_hf(real_model, reference):
    """Top-20 logits at the last prompt position within 1e-3; argmax equal at every position."""
    recs = reference["prompts"]
    lengths = [len(r["prompt_ids"]) for r in recs]
    width = max(lengths)
    ids = np.zeros((len(recs), width), np.int32)
    for i, r in enumerate(recs):
        ids[i, :lengths[i]] = r["prompt_ids"]
    cache = KVCache.create(real_model.config, len(recs), width)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), ids.shape)
    logits = np.asarray(forward(real_model.config, real_model.weights, jnp.asarray(ids), positions,
                                cache).logits)
    for i, r in enumerate(recs):
        n = lengths[i]
        row = logits[i, :n]  # right padding sits after the prompt: causal mask keeps these exact
        np.testing.assert_array_equal(row.argmax(-1), np.asarray(r["prompt_argmax"]),
                                      err_msg=r["text"])
        top_ids = np.asarray(r["last_top_ids"])
        got = row[-1, top_ids]
        diff = float(np.max(np.abs(got - np.asarray(r["last_top_logits"], np.float32))))
        assert diff <= LOGIT_TOL, f"{r['text']!r}: top-{len(top_ids)} logits differ by {diff}"


def test_greedy_matches_hf(real_model, reference):
    """jspec greedy == HF greedy until HF's first near-tie (top-2 gap < 0.05)."""
    recs = reference["prompts"]
    new_tokens = reference["new_tokens"]
    lengths = [len(r["prompt_ids"]) for r in recs]
    ids = np.zeros((len(recs), max(lengths)), np.int32)
    for i, r in enumerate(recs):
        ids[i, :lengths[i]] = r["prompt_ids"]
    out = jspec.generate(real_model, jnp.asarray(ids), jnp.asarray(lengths, jnp.int32),
                         max_new_tokens=new_tokens)
    tokens = np.asarray(out.tokens)
    out_lengths = np.asarray(out.lengths)
    for i, r in enumerate(recs):
        hf_ids = r["greedy_ids"]
        gaps = r["greedy_top2_gap"]
        ties = [s for s, g in enumerate(gaps) if g < NEAR_TIE]
        n = min(ties[0] if ties else len(hf_ids), len(hf_ids))
        # the step at a near-tie is not compared; everything before it must agree exactly
        assert n >= MIN_COMPARED, f"{r['text']!r}: only {n} comparable tokens"
        got = tokens[i, :n].tolist()
        assert got == hf_ids[:n], f"{r['text']!r}: jspec {got} != HF {hf_ids[:n]}"
        if not ties:  # whole HF continuation compared: lengths (EOS stop) must agree too
            assert int(out_lengths[i]) == len(hf_ids), r["text"]
