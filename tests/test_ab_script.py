"""scripts/ab.py, the one A/B timing script: the pairing (every arm once a round, the order
rotating), the ratio's spread, and its forward and generate A/Bs on a tiny model."""

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_model

import jspec

_SPEC = importlib.util.spec_from_file_location(
    "ab_script", Path(__file__).resolve().parents[1] / "scripts" / "ab.py")
ab = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ab)


def test_paired_calls_every_arm_once_a_round_in_rotating_order():
    calls = []
    arms = {n: (lambda n=n: calls.append(n) or n) for n in "abc"}
    secs, last = ab.paired(arms, rounds=3, warmup=1, start=1)
    # warm-up round (r = -1) starts at arm 0, then rounds start at arms 1, 2, 0
    assert calls == list("abc" "bca" "cab" "abc")
    assert {n: s.shape for n, s in secs.items()} == {n: (3,) for n in "abc"}
    assert all((s >= 0).all() for s in secs.values()) and last == {n: n for n in "abc"}


def test_spread_is_median_and_quartiles():
    s = ab.spread([1.0, 2.0, 3.0, 4.0, 5.0])
    assert s == {"median": 3.0, "q25": 2.0, "q75": 4.0, "n": 5}
    assert ab.fmt(s) == "3.00x (2.00-4.00)"
    assert ab.parse_arm("kernel:A=1,B=x") == ("kernel", {"A": "1", "B": "x"})
    assert ab.parse_arm("plain") == ("plain", {})


def test_forward_ab_times_every_arm_and_size_and_restores_the_environment(monkeypatch):
    monkeypatch.delenv("JSPEC_AB_TEST", raising=False)
    arms = [("one", {"JSPEC_AB_TEST": "1"}), ("two", {"JSPEC_AB_TEST": "2"})]
    res = ab.forward_ab(tiny_model(), arms, [2, 1], fill=5, repeats=3)
    assert "JSPEC_AB_TEST" not in os.environ
    assert set(res["ms"]) == {"one", "two"} and set(res["ms"]["one"]) == {1, 2}
    assert res["c"]["one"][1] == 1.0 and res["ratio"]["one"][2]["median"] == 1.0
    assert res["ratio"]["two"][1]["n"] == 3 and res["ms"]["two"][2] > 0


def test_generate_ab_pairs_configurations_per_prompt():
    model = tiny_model()
    configs = [("autoregressive", {}),
               ("ngram@2", {"drafter": jspec.load_drafter("ngram", target=model),
                            "length": jspec.FixedLength(2)})]
    rng = np.random.default_rng(0)
    rows = [(s, rng.integers(1, model.config.vocab_size, 6).tolist())
            for s in ("x", "x", "y")]
    said = []
    res = ab.generate_ab(model, configs, rows, temperature=0.0, new_tokens=8, say=said.append)
    assert len(said) == 3 and [r["config"] for r in res["rows"]] == ["autoregressive", "ngram@2"]
    base, spec = res["rows"]
    assert base["vs_ar"] == pytest.approx(1.0) and base["vs_ar_spread"]["median"] == 1.0
    assert spec["vs_ar_spread"]["n"] == 3 and set(spec["vs_ar_by_set"]) == {"x", "y"}
    assert spec["tokens_per_s"] > 0 and spec["tau"] >= 1.0


def test_checkouts_alternate_processes_and_pair_their_rounds(monkeypatch, capsys):
    """`checkouts`: one `generate` process per checkout a round (PYTHONPATH = the checkout, the
    order rotating), each checkout's tokens/s over the first's taken within a round."""
    calls, speed = [], {"/a": [10.0, 20.0], "/b": [12.0, 30.0]}

    def run(cmd, env, **kw):
        d = env["PYTHONPATH"]
        calls.append((d, cmd[2:]))
        tps = speed[d][sum(1 for c, _ in calls if c == d) - 1]
        line = {"temperature": 0.0, "jspec": d, "rows": [
            {"config": "autoregressive", "tokens_per_s": tps}]}
        return type("P", (), {"returncode": 0, "stdout": "progress\n" + json.dumps(line)})()

    monkeypatch.setattr(ab.subprocess, "run", run)
    ab.main(["checkouts", "--rounds", "2", "/a", "/b", "--", "--temperatures", "0"])
    assert calls == [("/a", ["generate", "--temperatures", "0"]),
                     ("/b", ["generate", "--temperatures", "0"]),
                     ("/b", ["generate", "--temperatures", "0"]),
                     ("/a", ["generate", "--temperatures", "0"])]
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    a, b = out["rows"][0]["checkouts"]
    assert a["vs_first"]["median"] == 1.0 and b["tokens_per_s"] == 21.0
    assert b["vs_first"] == pytest.approx({"median": 1.35, "q25": 1.275, "q75": 1.425, "n": 2})
