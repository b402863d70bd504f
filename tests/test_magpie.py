"""`python -m train magpie`'s filters: held-out overlap refused, degenerate repeats and
near-duplicates dropped; the pre-query template of the real tokenizer."""

from __future__ import annotations

import pytest

from train.magpie import Dedup, HeldOut, degenerate, heldout_texts, pre_query_ids

HELD = ["Write a function that returns the sum of the squares of all odd numbers in a list.",
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many."]


def test_heldout_overlap_is_refused_and_fresh_text_passes():
    held = HeldOut(HELD)
    # Control (A/A): unrelated prompts pass.
    assert not held.overlaps("Explain how a rainbow forms after a summer storm.")
    assert not held.overlaps("Write a function that reverses a string.")  # < 8 shared words
    # Broken variants: a held-out prompt verbatim, re-cased and re-punctuated, or embedded.
    assert held.overlaps(HELD[0])
    assert held.overlaps("WRITE a function, that returns the sum of the squares -- please")
    assert held.overlaps("Hi! Natalia sold clips to 48 of her friends in April. Why?")


@pytest.mark.real
def test_real_heldout_set_covers_the_benchmark_prompts():
    from jspec.prompts import load_prompt_set

    held = HeldOut(heldout_texts())
    for spec in ("humaneval:8", "gsm8k:0-20", "mtbench:60-80", "alpaca:0-64"):
        assert all(held.overlaps(r["text"]) for r in load_prompt_set(spec)
                   if len(r["text"].split()) >= 8), spec
    # a training-split prompt is not held out (the check is not "refuse everything")
    train = load_prompt_set("alpaca:100-140")
    assert sum(held.overlaps(r["text"]) for r in train) < len(train) // 4


def test_degenerate_and_near_duplicates():
    assert degenerate("hi")  # too short
    assert degenerate("tell me tell me tell me tell me a story please now")
    assert degenerate(" ".join(["cat"] * 30))
    assert not degenerate("How do I bake sourdough bread at home with a simple starter?")
    d = Dedup()
    assert d.add("How do I bake sourdough bread at home with a simple starter?")
    assert not d.add("How do I bake sourdough bread at home with a simple starter??")
    assert not d.add("how do i bake sourdough bread at home with a simple starter today")
    assert d.add("What are the main causes of the French Revolution?")


@pytest.mark.real
def test_real_pre_query_template(real_model):
    ids = pre_query_ids(real_model)
    text = real_model.tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\n") and "<|im_end|>" in text  # the system turn
    # the same prefix as a real user turn's
    full = real_model.encode("Hello there")
    assert full[:len(ids)] == ids
