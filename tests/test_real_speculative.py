"""Speculative decoding on the real SmolLM2-135M: greedy output identical to autoregressive."""

from __future__ import annotations

import numpy as np
import pytest

import jspec
from jspec.prompts import humaneval

N_NEW = 48


def _batch(model, texts):
    enc = [model.encode(t) for t in texts]
    width = max(map(len, enc))
    ids = np.zeros((len(enc), width), np.int32)
    for i, e in enumerate(enc):
        ids[i, : len(e)] = e
    return ids, np.asarray([len(e) for e in enc], np.int32)


@pytest.fixture(scope="module")
def prompts():
    rows = humaneval()
    return [rows[i]["text"] for i in (0, 2)] + ["List three primary colors.",
                                              "Explain photosynthesis in one sentence."]


@pytest.fixture(scope="module")
def reference(real_model, prompts):
    ids, lengths = _batch(real_model, prompts)
    return jspec.generate(real_model, ids, lengths, max_new_tokens=N_NEW)


CASES = [(d, k, b) for d in ("ngram", "early-exit:8") for k in (1, 4, 8) for b in (1, 4)]
FAST = {("ngram", 4, 4)}


@pytest.mark.real
@pytest.mark.parametrize("drafter_name, k, batch", [
    pytest.param(*c, marks=() if c in FAST else pytest.mark.slow) for c in CASES])
def test_real_greedy_speculative_equals_autoregressive(real_model, prompts, reference,
                                                       drafter_name, k, batch):
    drafter = jspec.load_drafter(drafter_name, target=real_model)
    ids, lengths = _batch(real_model, prompts)
    outs = []
    for s in range(0, len(prompts), batch):
        out = jspec.generate(real_model, ids[s:s + batch], lengths[s:s + batch],
                             max_new_tokens=N_NEW, drafter=drafter, length=jspec.FixedLength(k))
        outs.append(np.asarray(out.tokens))
        tau = out.stats.mean_accepted()
        assert (tau >= 1.0).all()
    np.testing.assert_array_equal(np.concatenate(outs), np.asarray(reference.tokens))
