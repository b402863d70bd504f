"""Prompt sets (`jspec.prompts.load_prompt_set`) and bench's split of its rows by set."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from conftest import tiny_model

from jspec import bench, cli
from jspec.errors import JspecError
from jspec.prompts import load_prompt_set


def test_several_sets_join_in_order_and_name_their_set():
    one = load_prompt_set("humaneval:0-2")
    both = load_prompt_set("humaneval:0-2, gsm8k:3")
    assert [r["text"] for r in both[:2]] == [r["text"] for r in one]
    assert [r["set"] for r in both] == ["humaneval:0-2"] * 2 + ["gsm8k:3"] * 3
    assert both[2]["text"] == load_prompt_set("gsm8k:1")[0]["text"]


@pytest.mark.parametrize("spec,msg", [
    ("humaneval:0-2,", "empty prompt set"),
    ("humaneval:2,humaneval:2", "named twice"),
    ("humaneval:2,nope:3", "unknown prompt set"),
    ("humaneval:2,gsm8k:x", "bad prompt range"),
    ("gsm8k:5-5", "is empty"),
])
def test_bad_prompt_specs_are_clear_errors(spec, msg):
    with pytest.raises(JspecError, match=msg):
        load_prompt_set(spec)


class _ByteTokenizer:
    """Characters mod the tiny vocabulary (no chat template)."""

    def encode(self, text, add_special_tokens=False):
        return [2 + ord(c) % 90 for c in text[:12]]


def test_bench_splits_rows_by_prompt_set(monkeypatch, capsys):
    """Two sets in one bench run: a second table and `by_set` in every row whose set parts add
    up to the whole (tau: emitted over rounds of each set's prompts). A drafter named twice
    with two lengths runs both."""
    model = dataclasses.replace(tiny_model(), tokenizer=_ByteTokenizer())
    monkeypatch.setattr(bench.jspec, "load_model", lambda *a, **k: model)
    monkeypatch.setattr(bench, "cost_curve", lambda *a, **k: {"c": {1: 1.0, 8: 1.5}})
    args = cli.build_parser().parse_args([
        "bench", "--prompts", "humaneval:0-2,gsm8k:0-1", "--drafters", "ngram@2,ngram@1",
        "--new-tokens", "6", "--repeats", "1", "--temperatures", "0", "--no-peer", "--quiet"])
    res = bench.speculative(args)
    out = capsys.readouterr().out
    assert "By prompt set" in out and "humaneval:0-2: tau" in out and "gsm8k:0-1: tau" in out
    ar, spec, spec1 = res["rows"]
    assert (spec1["drafter"], spec1["k"]) == ("ngram", 1)
    assert set(ar["by_set"]) == {"humaneval:0-2", "gsm8k:0-1"}
    assert all(b["tau"] == 1.0 and b["speedup_over_best_ar"] == pytest.approx(1.0)
               for b in ar["by_set"].values())
    assert spec["drafter"] == "ngram" and spec["k"] == 2
    taus = [b["tau"] for b in spec["by_set"].values()]
    assert min(taus) <= spec["tau"] + 1e-9 and spec["tau"] <= max(taus) + 1e-9
    assert all(1.0 <= t <= 3.0 for t in taus)
    for row in res["rows"]:
        assert sum(b["new_tokens"] for b in row["by_set"].values()) == row["new_tokens"]
    jax.clear_caches()


def test_bench_decodes_each_prompt_with_every_configuration_back_to_back(monkeypatch):
    """Timing order: every configuration compiles first, then prompt i is decoded by every
    configuration in turn, starting at configuration i mod C (rotating), before prompt i + 1
    — so rows are compared on calls seconds apart (a config-by-config pass fails this)."""
    model = dataclasses.replace(tiny_model(), tokenizer=_ByteTokenizer())
    monkeypatch.setattr(bench.jspec, "load_model", lambda *a, **k: model)
    monkeypatch.setattr(bench, "cost_curve", lambda *a, **k: {"c": {1: 1.0, 8: 1.5}})
    calls = []
    real = bench.jspec.generate

    def spy(m, ids, lens, **kw):
        d = kw.get("drafter")
        key = kw["key"]  # timed: the bench's key of prompt i, jax.random.key(i) (repeat 0)
        calls.append((None if d is None else kw["length"].k,
                      tuple(np.asarray(jax.random.key_data(key)))))
        return real(m, ids, lens, **kw)

    monkeypatch.setattr(bench.jspec, "generate", spy)
    args = cli.build_parser().parse_args([
        "bench", "--prompts", "humaneval:0-3", "--drafters", "ngram@2,ngram@1",
        "--new-tokens", "4", "--repeats", "1", "--temperatures", "0", "--no-peer", "--quiet"])
    bench.speculative(args)
    configs = [None, 2, 1]  # autoregressive, ngram@2, ngram@1
    assert [c for c, _ in calls[:3]] == configs  # the compiles (warm-up calls), first
    timed = calls[3:]
    prompts = [p for _, p in timed[::3]]
    assert len(timed) == 9
    assert prompts == [tuple(np.asarray(jax.random.key_data(jax.random.key(i)))) for i in range(3)]
    for i in range(3):
        block = timed[3 * i:3 * i + 3]
        assert [c for c, _ in block] == [configs[(i + j) % 3] for j in range(3)], (i, block)
        assert {p for _, p in block} == {prompts[i]}
    jax.clear_caches()
