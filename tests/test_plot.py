"""Provenance records and the pictures of bench / training results."""

from __future__ import annotations

import json

import pytest

from jspec import cli
from jspec.errors import JspecError
from jspec.provenance import provenance

BENCH = {  # the shape `python -m jspec bench --json-out` writes (trimmed)
    "speculative": {
        "prompts": "humaneval:2", "dtype": "float32", "new_tokens": 32, "repeats": 1,
        "rho_8": 1.7, "cost": {"ms": {"1": 90.0, "8": 150.0}, "c": {"1": 1.0, "8": 1.7}},
        "tree_c": {"smollm2-135m-d2sd@7": {"nodes": 12, "c": 2.1}},
        "rows": [
            {"temperature": 0.0, "drafter": "autoregressive", "k": 0, "verifier": "lossless",
             "tokens_per_s": 30.0, "speedup": 1.0, "speedup_over_best_ar": 1.0, "tau": 1.0,
             "accept_by_position": []},
            *[{"temperature": 0.0, "drafter": "ngram", "k": k, "verifier": "lossless",
               "tokens_per_s": 31.0 + k, "speedup": 1.0 + k / 50,
               "speedup_over_best_ar": 1.0 + k / 50, "tau": 1.2 + k / 20, "mean_length": k,
               "accept_by_position": [0.5 / (j + 1) for j in range(k)]} for k in (2, 4)],
            *[{"temperature": 0.0, "drafter": "smollm2-135m-eagle3", "k": k,
               "verifier": "lossless", "tokens_per_s": 28.0, "speedup": 0.9,
               "speedup_over_best_ar": 0.9, "tau": 1.5 + k / 10, "mean_length": k,
               "accept_by_position": [0.6 ** (j + 1) for j in range(k)]} for k in (2, 3)],
            {"temperature": 0.0, "drafter": "smollm2-135m-d2sd", "k": 7,
             "verifier": "lossless", "tokens_per_s": 25.0, "speedup": 0.8,
             "speedup_over_best_ar": 0.8, "tau": 1.9, "mean_length": 7,
             "accept_by_position": [0.5, 0.3, 0.2, 0.1, 0.05, 0.0, 0.0]},
            {"temperature": 0.0, "drafter": "smollm2-135m-dflash", "k": "libraspec",
             "verifier": "lossless", "tokens_per_s": 27.0, "speedup": 0.9,
             "speedup_over_best_ar": 0.9, "tau": 1.6, "mean_length": 3.2,
             "accept_by_position": [0.5, 0.3, 0.1]}]},
    "ar_batch": [{"batch": b, "tokens_per_s": 30.0 * b ** 0.7, "attention_impl": "xla"}
                 for b in (1, 16, 64)],
    "provenance": {"cpu": "Test CPU", "device_kind": "cpu"},
}


def test_provenance_records_machine_versions_dtype_and_command():
    p = provenance(dtype="bfloat16", argv=["-m", "jspec", "bench", "--prompts", "a b"])
    for key in ("cpu", "backend", "device_kind", "device_count", "jax", "jaxlib", "python",
                "dtype", "command", "time_utc"):
        assert key in p, key
    assert p["dtype"] == "bfloat16" and p["device_count"] >= 1
    assert p["command"].endswith("-m jspec bench --prompts 'a b'")
    json.dumps(p)  # JSON-ready


def test_plot_bench_and_cli(tmp_path):
    pytest.importorskip("matplotlib")
    from jspec.plot import plot_bench

    out = plot_bench(BENCH, tmp_path / "b.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(BENCH))
    assert cli.main(["plot", str(src), str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 20_000
    (tmp_path / "empty.json").write_text("{}")
    assert cli.main(["plot", str(tmp_path / "empty.json"), str(tmp_path / "d.png")]) == 2


def test_plot_training_log(tmp_path):
    pytest.importorskip("matplotlib")
    from jspec.plot import plot_training
    from train.drafters import plot_log

    log = tmp_path / "run" / "log.jsonl"
    log.parent.mkdir()
    recs = [{"step": s, "loss": 8.0 / s ** 0.3, "acc1": 0.1, "tau_sim": 1.0 + s / 200,
             **({"heldout_tau_sim": 1.0 + s / 250, "heldout_tau_replay": 1.0 + s / 300}
                if s % 10 == 0 else {})}
            for s in range(1, 51)]
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert plot_training(log, tmp_path / "t.png").stat().st_size > 10_000
    assert plot_log(log) == log.with_name("training.png") and plot_log(log).is_file()
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(JspecError, match="no steps"):
        plot_training(tmp_path / "e.jsonl", tmp_path / "e.png")


def test_plot_grpo_log_draws_reward_and_rollout_tau(tmp_path, recwarn):
    """A `train grpo` log: the reward (and its 10-step mean) in place of the surrogate loss,
    the rollouts' τ; no panel without a line (no matplotlib "no artists" warning)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from jspec.plot import plot_training

    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 0.0, "reward": 0.3 + s / 100,
                                       "tau": 1.2}) + "\n" for s in range(1, 21)))
    seen = {}
    real = plt.Figure.savefig

    def grab(fig, *a, **k):
        seen["lines"] = [[ln.get_label() for ln in ax.get_lines()] for ax in fig.axes]
        return real(fig, *a, **k)

    plt.Figure.savefig = grab
    try:
        plot_training(log, tmp_path / "g.png")
    finally:
        plt.Figure.savefig = real
    assert seen["lines"] == [["rollouts' reward", "10-step mean"],
                             ["rollouts (measured; train grpo)"]]
    assert not [w for w in recwarn if "No artists" in str(w.message)]


def test_plot_aot_report_and_cli(tmp_path):
    """A `jspec aot` report's JSON draws (c(T) and HBM read per program), also through
    `python -m jspec plot`, which tells it from a bench result."""
    pytest.importorskip("matplotlib")
    from jspec.plot import plot_aot

    rows = [{"t": t, "tree": tree, "ok": True, "c_modelled": 1 + 0.01 * t,
             "hbm_bytes_read": 2.4e9 + 1e6 * t} for t in (1, 4, 16) for tree in (False, True)]
    rep = {"model": "m", "topology": "v5e:2x4", "batch": 8, "context": 4096,
           "layers": "scanned", "byte_floor_per_chip": 2.41e9, "programs": rows}
    out = plot_aot(rep, tmp_path / "a.png")
    assert out.stat().st_size > 10_000
    src = tmp_path / "r.json"
    src.write_text(json.dumps(rep))
    assert cli.main(["plot", str(src), str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 10_000
