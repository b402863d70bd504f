"""`python -m jspec.gpu_e2e`'s CPU dry run (--tiny): every section, an injected failure, the time
budget, and a kill mid-run (the JSON is rewritten after every row)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("setup", "autoregressive", "speculative", "cost_curve", "llama8b", "kernel_check")


def _cmd(out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "jspec.gpu_e2e", "--tiny", "--out", str(out), *flags]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user runs it (conftest asks for 8)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(out: Path, *flags: str) -> tuple[dict, str]:
    proc = subprocess.run(_cmd(out, *flags), capture_output=True, text=True, timeout=900,
                          env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_tiny_dry_run_has_every_section_and_an_injected_failure_is_one_error_row(tmp_path):
    doc, stdout = _run(tmp_path / "e2e.json", "--inject-failure", "--time-budget", "900")
    prov = doc["provenance"]
    assert prov["backend"] == "cpu" and prov["device_kind"] and prov["device_count"] >= 1
    assert prov["jax"] and prov["jaxlib"] and "--tiny" in prov["command"]
    assert "--inject-failure" in prov["argv"]
    assert doc["config"]["dtype"] == "bfloat16" and doc["config"]["tiny"]
    st = doc["status"]
    assert st["complete"] and not st["stopped_early"] and st["skipped"] == []
    for s in SECTIONS:
        assert doc[s], f"section {s} is empty"
        for r in doc[s]:
            assert "memory" in r and r["seconds"] >= 0  # memory: null on CPU
    errors = [(s, r) for s in SECTIONS for r in doc[s] if r["error"]]
    assert [(s, r["name"]) for s, r in errors] == [("speculative", "injected failure")]
    assert errors[0][1]["injected"] and "no-such-impl" in errors[0][1]["error"]

    ar = doc["autoregressive"]
    assert {(r["batch"], r["attention_impl"]) for r in ar} >= {(1, "xla"), (1, "pallas"), (4, "xla")}
    for r in ar:
        assert _positive(r["tokens_per_s"]) and _positive(r["end_to_end_tokens_per_s"])
        assert r["new_tokens"] == r["batch"] * doc["config"]["ar_new_tokens"]

    spec = [r for r in doc["speculative"] if not r["error"]]
    assert {r["drafter"] for r in spec} == {"autoregressive", "ngram", "eagle3", "dflash", "d2sd"}
    assert {r["temperature"] for r in spec} == {0.0, 1.0}
    assert {r["attention_impl"] for r in spec} == {"xla", "pallas"}
    for r in spec:
        assert _positive(r["tokens_per_s"]) and r["tau"] >= 1.0 and _positive(r["speedup"])
        assert _positive(r["speedup_vs_best_ar"]) and _positive(r["compile_s"])
        assert set(r["per_set"]) == set(doc["config"]["prompt_specs"]) == {"humaneval:0-2"}
        for v in r["per_set"].values():
            assert _positive(v["tokens_per_s"]) and v["tau"] >= 1.0
        if r["drafter"] == "autoregressive":
            assert r["speedup"] == 1.0 and r["tau"] == 1.0
    tree = [r for r in spec if r["drafter"] == "d2sd"]
    assert tree and all(r["k"] == 5 and r["tree_nodes"] == 10 for r in tree)  # 1 + 5 + 4 branches
    assert any(r["tau"] > 1.0 for r in spec if r["drafter"] == "ngram")  # repetitive prompts

    for section in ("cost_curve", "llama8b"):
        curves = [r for r in doc[section] if "points" in r]
        assert {r.get("mask", r.get("kind")) for r in curves} == {"chain", "tree"}
        for r in curves:
            assert _positive(r["ms_1"]) and r["points"]
            assert all(_positive(p["ms"]) and _positive(p["c"]) for p in r["points"])
    chain = next(r for r in doc["cost_curve"] if r["mask"] == "chain")
    assert [p["K"] for p in chain["points"]] == doc["config"]["cost_ks"]
    tree_curve = next(r for r in doc["cost_curve"] if r["mask"] == "tree")
    assert [p["nodes"] for p in tree_curve["points"]] == [16, 64]
    build = doc["llama8b"][0]
    assert build["kind"] == "build" and _positive(build["param_bytes"])
    for r in doc["kernel_check"]:
        assert r["finite"] and r["argmax_agree"] >= 0.9 and r["rel_err"] < 0.05  # bf16

    # The printed markdown tables.
    for head in ("| batch | attention |", "| T | attention | drafter |", "| attention | t(1) ms |",
                 "| model | nodes | fill |", "| section | row | error |"):
        assert head in stdout


def test_time_budget_stops_starting_rows_and_leaves_valid_json(tmp_path):
    doc, stdout = _run(tmp_path / "e2e.json", "--time-budget", "0.5")
    st = doc["status"]
    assert st["stopped_early"] and not st["complete"]
    ran = [r for s in SECTIONS for r in doc[s]]
    assert [r["name"] for r in ran] == ["target"]  # the only row started within 0.5 s
    assert ran[0]["error"] is None
    assert any(x.startswith("speculative/") for x in st["skipped"])
    assert any(x.startswith("llama8b/") for x in st["skipped"])
    assert "stopped early: True" in stdout
    listed = subprocess.run(_cmd(tmp_path / "unused.json", "--list"), capture_output=True,
                            text=True, timeout=300, env=_env(), cwd=ROOT).stdout.splitlines()
    assert listed[0] == "setup/target" and "speculative/T=0 xla d2sd K=block" in listed
    assert "speculative/injected failure" not in listed and not (tmp_path / "unused.json").exists()


def test_a_kill_mid_run_leaves_every_finished_row(tmp_path):
    out = tmp_path / "e2e.json"
    proc = subprocess.Popen(_cmd(out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=_env(), cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if out.is_file() and json.loads(out.read_text())["autoregressive"]:
                break
            time.sleep(0.5)
        else:
            pytest.fail("no autoregressive row within 300 s")
    finally:
        proc.kill()
        proc.wait()
    doc = json.loads(out.read_text())  # complete JSON: written to a temporary file, then renamed
    assert not doc["status"]["complete"]
    assert doc["setup"] and doc["autoregressive"][0]["error"] is None
