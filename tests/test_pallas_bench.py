"""pallas_kernels.bench: the device-check script runs end to end (tiny sizes, interpret mode)."""

from __future__ import annotations

import json

import pytest

from pallas_kernels import bench


@pytest.mark.slow
def test_bench_runs_and_reports_correctness(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "attention_configs", lambda small, backend: [
        dict(b=2, t=4, h=4, kv=2, hd=16, prefix=20, s=32, dtype="float32")])
    monkeypatch.setattr(bench, "acceptance_configs", lambda small, backend: [
        dict(b=2, k=2, v=300, temperature=1.0)])
    out = tmp_path / "bench.json"
    assert bench.main(["--small", "--json-out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["interpret"] and res["small"]
    (att,) = res["tree_attention"]
    (acc,) = res["relaxed_acceptance"]
    assert att["ok"] and att["max_abs_err"] < 1e-5 and att["kernel_ms"] > 0
    assert acc["ok"] and acc["tokens_identical"]
    assert "all correct: True" in capsys.readouterr().out


def test_bench_reports_a_failing_kernel_without_crashing(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "attention_configs", lambda small, backend: [
        dict(b=1, t=2, h=2, kv=1, hd=8, prefix=4, s=10, dtype="float16")])  # float16: rejected
    monkeypatch.setattr(bench, "acceptance_configs", lambda small, backend: [])
    out = tmp_path / "bench.json"
    assert bench.main(["--json-out", str(out)]) == 1
    (att,) = json.loads(out.read_text())["tree_attention"]
    assert not att["ok"] and "float32 or bfloat16" in att["error"]
