"""Many prompts in batches (`jspec.batched`, `generate --batch-size`): order, equality with
one-by-one decoding, one compile per width bucket, bad lines skipped without losing the rest."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import tiny_model

import jspec
from jspec.batched import batch_plan, generate_batches
from jspec.cli import main
from jspec.decode import _generate
from jspec.drafters import NGram

# Lengths chosen to span two width buckets (<= 32 and 33..64).
LENGTHS = [5, 40, 3, 12, 36, 7, 20]


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(x) for x in rng.integers(3, vocab, n)] for n in LENGTHS]


def test_batch_plan_groups_by_length():
    plan = batch_plan(LENGTHS, 3)
    assert [len(b) for b in plan] == [3, 3, 1]
    assert sorted(i for b in plan for i in b) == list(range(len(LENGTHS)))
    flat = [LENGTHS[i] for b in plan for i in b]
    assert flat == sorted(LENGTHS)
    with pytest.raises(jspec.JspecError, match="batch_size"):
        batch_plan(LENGTHS, 0)


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_batches_equal_one_by_one_in_input_order(drafter):
    """Greedy: each prompt's tokens from the batched run equal decoding it alone (batch 1), and
    the results come back in input order."""
    model = tiny_model()
    d = NGram() if drafter else None
    prompts = _prompts(model.config.vocab_size)
    got = list(generate_batches(model, prompts, 3, max_new_tokens=6, drafter=d))
    assert [r.index for r in got] == list(range(len(prompts)))
    for r, p in zip(got, prompts, strict=True):
        alone = jspec.generate(model, np.asarray([p], np.int32), max_new_tokens=6, drafter=d)
        n = int(alone.lengths[0])
        assert r.tokens == [int(t) for t in np.asarray(alone.tokens)[0, :n]]
        assert r.rounds >= 1 and r.mean_accepted >= 1.0


def test_one_compile_per_bucket():
    """7 prompts in batches of 3 over two width buckets (the short last batch is padded to 3
    rows): at most two programs, and a second run compiles nothing."""
    model = tiny_model()
    prompts = _prompts(model.config.vocab_size)
    before = _generate._cache_size()
    list(generate_batches(model, prompts, 3, max_new_tokens=4))
    first = _generate._cache_size() - before
    assert 1 <= first <= 2
    list(generate_batches(model, prompts[::-1], 3, max_new_tokens=4))
    assert _generate._cache_size() - before == first


@pytest.mark.real
def test_real_cli_batch_size_skips_bad_lines(real_model, tmp_path, capsys):
    """`generate --prompts-file --batch-size 2 --json`: every good prompt gets its row, in file
    order; a bad JSON line and an empty prompt are named on stderr; exit status 1."""
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join([
        json.dumps({"prompt": "What is the capital of France?"}),
        "{not json",
        json.dumps({"prompt": "Name a primary color."}),
        json.dumps({"prompt": "   "}),
        json.dumps({"prompt": "Write the number after 41, in digits."}),
    ]) + "\n")
    code = main(["generate", "--prompts-file", str(f), "--batch-size", "2", "--json",
                 "--max-new-tokens", "8"])
    out, err = capsys.readouterr()
    assert code == 1
    rows = [json.loads(x) for x in out.strip().splitlines()]
    assert [r["prompt"] for r in rows] == ["What is the capital of France?",
                                           "Name a primary color.",
                                           "Write the number after 41, in digits."]
    assert all(r["new_tokens"] == len(r["token_ids"]) >= 1 for r in rows)
    assert "Paris" in rows[0]["text"]
    assert "p.jsonl:2" in err and "not valid JSON" in err and "p.jsonl:4" in err
    assert "2 prompt(s) skipped" in err
    # The first prompt alone (batch 1, the default path): the same greedy tokens.
    single = tmp_path / "one.jsonl"
    single.write_text(json.dumps({"prompt": "What is the capital of France?"}) + "\n")
    assert main(["generate", "--prompts-file", str(single), "--json",
                 "--max-new-tokens", "8"]) == 0
    assert json.loads(capsys.readouterr().out.strip())["token_ids"] == rows[0]["token_ids"]


def test_bench_batched_rows_on_a_tiny_model():
    """`bench --batch-sizes`' jspec measurement: every row decodes exactly new_tokens (EOS
    ignored), speculative rows report tau, and the planned peak memory grows with the batch."""
    from jspec import bench_batch

    model = tiny_model()
    prompts = _prompts(model.config.vocab_size)
    r1 = bench_batch.jspec_batched(model, prompts, 1, 5, repeats=1)
    r4 = bench_batch.jspec_batched(model, prompts, 4, 5, repeats=1)
    assert r1["new_tokens"] == r4["new_tokens"] == 5 * len(prompts)
    assert r1["tokens_per_s"] > 0 and r4["peak_bytes"] > r1["peak_bytes"] > 0
    s = bench_batch.jspec_batched(model, prompts, 4, 5, repeats=1, drafter=NGram(),
                                  length=jspec.FixedLength(2), ignore_eos=False)
    assert s["tau"] >= 1.0 and 0 < s["new_tokens"] <= 5 * len(prompts)


def test_bench_batch_sizes_bad_value_is_a_clear_error(capsys):
    assert main(["bench", "--batch-sizes", "1,x"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err
