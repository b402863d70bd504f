"""Speculative decoding on the real SmolLM2-135M: greedy output identical to autoregressive,
sampled output distributed as autoregressive sampling (per-position χ² over independent rows)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from stats import compare_positions, generate_rows_shared_prefill
from test_distribution import ResidualFromP

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


# The last case: the cpu-bf16 default, EAGLE-3 drafting 2 with looked-up chains of up to 4
# (two verify widths; the drafter's state takes paths longer than its chains).
LOOK = ("smollm2-135m-eagle3+ngram:look=4", 2, 4)
# EAGLE-2-style trees (depth 3, 6 nodes) whose looked-up rows propose a 4-token chain instead.
TREE_LOOK = ("smollm2-135m-eagle3+topk:k=3,nodes=6,width=2+ngram:look=4", 3, 2)
CASES = [(d, k, b) for d in ("ngram", "early-exit:8") for k in (1, 4, 8) for b in (1, 4)] + [
    LOOK, TREE_LOOK]
FAST = {("ngram", 4, 4), LOOK}


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


# ---------------------------------------------------------------- sampled output distributions
# Independent rows of one prompt, one χ² per new-token position, Holm over the positions
# (tests/stats.py). The prompt is prefilled once and its state copied into every row
# (`generate_rows_shared_prefill`): token 0 is then fixed (it conditions every row alike), and
# rows differ from token 1 on; K = 2 drafted slots, so positions 1..3 cover every slot of the
# first round (bonus included). Seeds: autoregressive 1, A/A control 2, speculative 3.
# Rows per side: 1024 at T = 1 (the main cases), 512 with top-p / top-k (a top-p sort over the
# 49,152-token vocabulary per position makes those rounds ~2x dearer on this CPU).
DIST_BATCH, DIST_ALPHA, DIST_K = 256, 0.01, 2
DIST_POSITIONS = range(1, DIST_K + 2)
AR_SEED, AA_SEED, SPEC_SEED = 1, 2, 3
SAMPLINGS = {"T1": jspec.Sampling(temperature=1.0),
             "T0.7-p0.9": jspec.Sampling(temperature=0.7, top_p=0.9),
             "T1-k50": jspec.Sampling(temperature=1.0, top_k=50)}
# (prompt, sampling) -> (rows per side, the least Σ dof a test over it must have). At T = 0.7 +
# top-p 0.9 the math answer is nearly forced at t = 1, 2 (one nucleus token): dof ≈ 4 in all.
DIST_PAIRS = {("math", "T1"): (1024, 6), ("math", "T0.7-p0.9"): (512, 3),
              ("math", "T1-k50"): (512, 6), ("colors", "T1-k50"): (512, 6)}


@functools.cache
def _dist_prompt(model, name: str) -> tuple[int, ...]:
    """"math": a held-out math prompt and the first 12 tokens of the greedy answer (what the
    trained drafters were trained on: EAGLE-3 reaches τ ≈ 2 here at K = 3, T = 1);
    "colors": a prompt that makes the answer repeat its own context, so n-gram drafts are
    accepted (τ ≈ 1.26 at K = 3, T = 1; elsewhere n-gram τ is ≈ 1.0)."""
    if name == "colors":
        return tuple(model.encode("Name colors in a loop: red, green, blue, red, green, blue, "
                                  "red, green, blue, red, green, blue. Continue the loop."))
    from jspec.prompts import load_prompt_set

    ids = model.encode(load_prompt_set("math:1")[0]["text"])
    greedy = jspec.generate(model, np.asarray([ids]), max_new_tokens=12)
    return tuple(ids) + tuple(int(t) for t in np.asarray(greedy.tokens[0]))


def _dist_rows(model, prompt: str, sampling: str, seed: int, rows: int, **kw):
    return generate_rows_shared_prefill(model, list(_dist_prompt(model, prompt)), rows,
                                        batch=min(rows, DIST_BATCH), seed=seed,
                                        max_new_tokens=DIST_K + 2, sampling=SAMPLINGS[sampling],
                                        **kw)


@functools.cache
def _dist_ar(model, prompt: str, sampling: str, seed: int, rows: int):
    return _dist_rows(model, prompt, sampling, seed, rows).tokens


def _dist_drafter(model, name: str) -> dict:
    if name == "ngram":
        return dict(drafter=jspec.load_drafter("ngram", target=model),
                    length=jspec.FixedLength(DIST_K))
    if name == "eagle3":
        return dict(drafter=jspec.load_drafter("smollm2-135m-eagle3", target=model),
                    length=jspec.FixedLength(DIST_K))
    dflash = jspec.load_drafter("smollm2-135m-dflash", target=model)
    if name == "dflash":
        return dict(drafter=dflash, length=jspec.FixedLength(DIST_K))
    # d ∈ {1, 2} per row: cut to 1 when 3·q_1 < 1 (q_1: the first slot's max probability;
    # often at T > 0), else a second block is drafted, anchored on the sampled x_1
    # (LibraSpec's multi-block path), and its first slot verified too.
    assert name == "libraspec"
    return dict(drafter=dflash, length=jspec.LibraSpec(n=1, d_max=DIST_K, alpha=3.0))


@pytest.mark.real
def test_real_distribution_short(real_model):
    """Default-run check: n-gram drafts (one-hot q, K = 2) on the "colors" prompt at T = 1:
    256 rows per side (keys 1 and 3), one two-sample χ² per position 1..3 (rare tokens pooled
    at expected count < 5), Holm at α = 0.01; drafts accepted (> 0.5 per row: ≈ 1.3 measured;
    τ over 3-token windows says little, the last round's tokens being cut). The slow set runs
    the A/A control and the other drafters and sampling modes at 512-1024 rows."""
    ar = _dist_ar(real_model, "colors", "T1", AR_SEED, 256)
    sp = _dist_rows(real_model, "colors", "T1", SPEC_SEED, 256,
                    **_dist_drafter(real_model, "ngram"))
    assert (ar[:, 0] == sp.tokens[:, 0]).all()  # the same conditioning token 0
    test = compare_positions(ar, sp.tokens, DIST_POSITIONS, DIST_ALPHA)
    assert test.same, test
    assert sp.accepted_per_row > 0.5, sp.accepted_per_row
    assert test.dof >= 10, test


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("prompt, sampling", list(DIST_PAIRS))
def test_real_distribution_aa_control(real_model, prompt, sampling):
    """A/A control: two autoregressive samples (keys 1 and 2; 1024 rows each at T = 1, 512
    with top-p / top-k) through the statistic of `test_real_distribution_equivalence` (χ² per
    position 1..3, Holm α = 0.01): it must not reject (it does so with probability ≤ 1% when
    both samples come from one distribution, as here)."""
    rows, min_dof = DIST_PAIRS[prompt, sampling]
    test = compare_positions(_dist_ar(real_model, prompt, sampling, AR_SEED, rows),
                             _dist_ar(real_model, prompt, sampling, AA_SEED, rows),
                             DIST_POSITIONS, DIST_ALPHA)
    assert test.same, test
    assert test.dof >= min_dof, test


DIST_CASES = [("ngram", "colors", "T1-k50"), ("eagle3", "math", "T1"),
              ("eagle3", "math", "T0.7-p0.9"), ("dflash", "math", "T1-k50"),
              ("libraspec", "math", "T1")]


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("drafter_name, prompt, sampling", DIST_CASES)
def test_real_distribution_equivalence(real_model, drafter_name, prompt, sampling):
    """Speculative (K = 2; LibraSpec: n = 1, d_max = 2, α = 3) against autoregressive sampling
    of SmolLM2-135M: independent rows of one prompt per side (keys 3 and 1; 1024 rows at T = 1,
    512 with top-p / top-k), the marginal of each new token t = 1..3 compared by a two-sample
    χ² (tokens with expected count < 5 pooled into "other"), Holm at α = 0.01 over the three
    positions; drafts must be accepted (> 0.15 per row, so drafted slots are exercised;
    measured: EAGLE-3 ≈ 1.8, LibraSpec ≈ 0.7 at T = 1) and the tables spread (Σ dof ≥ 6, 3
    at top-p). n-gram: one-hot q; EAGLE-3 / DFlash / LibraSpec: the drafter's real q."""
    rows, min_dof = DIST_PAIRS[prompt, sampling]
    ar = _dist_ar(real_model, prompt, sampling, AR_SEED, rows)
    sp = _dist_rows(real_model, prompt, sampling, SPEC_SEED, rows,
                    **_dist_drafter(real_model, drafter_name))
    assert (ar[:, 0] == sp.tokens[:, 0]).all()
    test = compare_positions(ar, sp.tokens, DIST_POSITIONS, DIST_ALPHA)
    assert test.same, f"{drafter_name} at {sampling}: {test} ({sp.accepted_per_row:.2f} " \
        "accepted drafts per row)"
    assert sp.accepted_per_row > 0.15, sp.accepted_per_row
    assert test.dof >= min_dof, test


@pytest.mark.real
@pytest.mark.slow
def test_real_distribution_rejects_a_broken_verifier(real_model):
    """The statistic has teeth on the real model: EAGLE-3 at T = 1 on "math", verified by a
    broken verifier whose correction token is drawn from p instead of norm([p − q]+), is
    rejected by the same test (1024 rows per side, keys 3 and 1, χ² per position 1..3, Holm
    α = 0.01)."""
    ar = _dist_ar(real_model, "math", "T1", AR_SEED, 1024)
    sp = _dist_rows(real_model, "math", "T1", SPEC_SEED, 1024, verifier=ResidualFromP(),
                    **_dist_drafter(real_model, "eagle3"))
    test = compare_positions(ar, sp.tokens, DIST_POSITIONS, DIST_ALPHA)
    assert not test.same, f"the broken verifier was not detected: {test}"


ASD_CASES = [("ngram", 4, jspec.ASD(budget=0.0)), ("early-exit:8", 4, jspec.ASD(gate=0.0)),
             ("early-exit:8", 8, jspec.ASD(cap=0)), ("ngram", 8, jspec.ASD(gate=0.0))]


@pytest.mark.real
@pytest.mark.parametrize("drafter_name, k, asd", [
    pytest.param(*c, marks=() if i == 0 else pytest.mark.slow) for i, c in enumerate(ASD_CASES)])
def test_real_asd_zero_settings_equal_greedy(real_model, prompts, reference, drafter_name, k, asd):
    drafter = jspec.load_drafter(drafter_name, target=real_model)
    ids, lengths = _batch(real_model, prompts)
    out = jspec.generate(real_model, ids, lengths, max_new_tokens=N_NEW, drafter=drafter,
                         length=jspec.FixedLength(k), verifier=asd)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(reference.tokens))


@pytest.mark.real
@pytest.mark.slow
def test_real_bfloat16_greedy_speculative_differs_only_at_near_ties(real_model, prompts):
    """bfloat16 target: greedy verification commits the verify pass's argmax, which rounds
    differently from a one-token step, so outputs may part, but only where the two tokens' logits
    are within bfloat16 noise. Sample: the 4 prompts x 48 tokens, n-gram K=4, EAGLE-3 K=3 and
    the cpu-bf16 default EAGLE-3 K=2 +ngram:look=4 (deterministic); threshold: a relative
    logit gap ≤ 2% of the top logit (bfloat16 rounding is 0.4%) at every first difference,
    under a teacher-forced bfloat16 forward."""
    import jax.numpy as jnp

    from jspec.models.cache import KVCache
    from jspec.models.llama import forward

    bf = real_model.astype("bfloat16")
    ids, lengths = _batch(bf, prompts)
    ar = jspec.generate(bf, ids, lengths, max_new_tokens=N_NEW)
    for name, k in (("ngram", 4), ("smollm2-135m-eagle3", 3),
                    ("smollm2-135m-eagle3+ngram:look=4", 2)):
        sp = jspec.generate(bf, ids, lengths, max_new_tokens=N_NEW, length=jspec.FixedLength(k),
                            drafter=jspec.load_drafter(name, target=bf))
        for r in range(len(prompts)):
            a = np.asarray(ar.tokens[r, : int(ar.lengths[r])])
            s = np.asarray(sp.tokens[r, : int(sp.lengths[r])])
            diff = np.flatnonzero(a[: len(s)] != s[: len(a)])
            if not diff.size:
                assert len(a) == len(s)
                continue
            j = int(diff[0])
            seq = list(ids[r, : lengths[r]]) + list(a[:j])
            fo = forward(bf.config, bf.weights, jnp.asarray([seq], jnp.int32),
                         jnp.arange(len(seq))[None], KVCache.create(bf.config, 1, len(seq) + 8))
            lg = np.asarray(fo.logits[0, -1], np.float64)
            gap = abs(lg[a[j]] - lg[s[j]]) / abs(lg.max())
            assert gap <= 0.02, (name, r, j, gap)
