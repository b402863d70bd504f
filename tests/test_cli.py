"""`python -m jspec`: bad input gives `error: ...` and exit status 2, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import jspec
from jspec.cli import main


@pytest.mark.parametrize("argv, match", [
    (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "--prompt", "hi", "--top-p", "0"], "top_p"),
    (["generate", "--prompt", "hi", "--top-p", "1.5"], "top_p"),
    (["generate", "--prompt", "hi", "--top-k", "-2"], "top_k"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "max-new-tokens"),
    (["generate", "--prompt", "   "], "empty"),
    (["generate", "--prompt", "hi", "--model", "no-such-model"], "unknown model"),
    (["generate", "--prompt", "hi", "--model", "/nonexistent/model.gguf"], "not found"),
    (["generate", "--prompt", "hi", "--k", "4"], "--drafter"),
    (["generate", "--prompts-file", "/nonexistent.jsonl"], "not found"),
    (["generate", "--prompt", "hi", "--acceptance-impl", "pallas"], "--drafter"),
    (["generate", "--prompt", "hi", "--drafter-alone"], "--drafter-alone need --drafter"),
    (["generate", "--prompt", "hi", "--drafter", "ngram", "--verifier", "asd",
      "--acceptance-impl", "pallas"], "lossless and DIVERSED verifiers only"),
    (["generate", "--prompt", "hi", "--mesh", "2x"], "DATAxMODEL"),
    (["generate", "--prompt", "hi", "--mesh", "16x16"], "devices"),
])
def test_bad_input_is_a_clear_error(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and match in err
    assert "Traceback" not in err


def test_impl_flags_parse():
    from jspec.cli import build_parser

    for cmd in (["generate", "--prompt", "hi"], ["bench", "--baseline"]):
        args = build_parser().parse_args(cmd)
        assert (args.attention_impl, args.acceptance_impl) == ("auto", "xla")
        args = build_parser().parse_args([*cmd, "--attention-impl", "pallas",
                                          "--acceptance-impl", "pallas"])
        assert (args.attention_impl, args.acceptance_impl) == ("pallas", "pallas")
        with pytest.raises(SystemExit):
            build_parser().parse_args([*cmd, "--attention-impl", "triton"])


def test_generate_dtype_is_the_measured_best(tmp_path, monkeypatch, capsys):
    """With no --dtype, plain and speculative `generate` load the target in the dtype of the
    machine class's records (`jspec.defaults.dtype_for`): the drafter's, else plain
    decoding's; an explicit --dtype wins. (The model load is stopped: only the choice runs.)"""
    from jspec.errors import JspecError

    seen = []

    def load_model(name, dtype=None, **kw):
        seen.append(dtype)
        raise JspecError("stopped")

    monkeypatch.setattr(jspec, "load_model", load_model)
    user = tmp_path / "user.json"
    user.write_text(json.dumps({"cpu": {"plain": {"dtype": "bfloat16", "source": "t"}}}))
    for cls, extra, want in [
            ("cpu", [], "float32"), ("cpu-bf16", [], "bfloat16"), ("gpu", [], "float32"),
            ("cpu-bf16", ["--drafter", "ngram"], "bfloat16"),
            ("cpu", ["--drafter", "ngram"], "float32"),
            ("cpu-bf16", ["--drafter", "early-exit:3"], "bfloat16"),  # no record: plain's
            ("cpu-bf16", ["--dtype", "float32"], "float32"),
            ("cpu-bf16", ["--drafter", "ngram", "--dtype", "float32"], "float32"),
            ("cpu", ["user"], "bfloat16")]:  # the user's plain record wins over the shipped
        monkeypatch.setenv("JSPEC_MACHINE_CLASS", cls)
        if extra == ["user"]:
            monkeypatch.setenv("JSPEC_DEFAULTS", str(user))
            extra = []
        assert main(["generate", "--prompt", "hi", *extra]) == 2
        assert seen.pop() == want, (cls, extra)
    capsys.readouterr()


def test_bad_prompts_file(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    assert main(["generate", "--prompts-file", str(f)]) == 2
    assert "p.jsonl:2" in capsys.readouterr().err
    f.write_text("not json\n")
    assert main(["generate", "--prompts-file", str(f)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_truncated_gguf_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 10)
    assert main(["generate", "--prompt", "hi", "--model", str(bad)]) == 2
    assert "cannot read GGUF" in capsys.readouterr().err


@pytest.mark.real
def test_real_prompt_longer_than_context_is_a_clear_error(real_model, capsys):
    long = "word " * 9000
    assert main(["generate", "--prompt", long, "--max-new-tokens", "4"]) == 2
    assert "context length" in capsys.readouterr().err


@pytest.mark.real
def test_real_json_output_and_drafter(real_model, tmp_path, capsys, monkeypatch):
    """The CLI end to end: --json fields in a subprocess (`python -m jspec`), then the same
    command in this process (`jspec.cli.main`, the entry point's function) with a drafter:
    greedy identity, and the machine-class records choosing dtype and k."""
    import warnings

    from jspec import defaults

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "What is the capital of France?"}) + "\n")
    argv = ["generate", "--prompts-file", str(f), "--json", "--max-new-tokens", "16"]

    def check(rec):
        assert set(rec) == {"prompt", "text", "token_ids", "new_tokens", "rounds",
                            "mean_accepted", "seconds", "provenance"}
        prov = rec["provenance"]  # where and how: machine, versions, dtype, the command
        assert prov["dtype"] == "float32" and prov["device_count"] >= 1 and prov["jaxlib"]
        assert rec["new_tokens"] == len(rec["token_ids"]) and "Paris" in rec["text"]
        return rec

    # Plain decoding in the measured-best dtype of the machine class (its "plain" record):
    # float32 on a `cpu` machine.
    env = {**os.environ, "JSPEC_MACHINE_CLASS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "jspec", *argv], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    plain = check(json.loads(proc.stdout.strip().splitlines()[-1]))
    command = plain["provenance"]["command"]  # (in this process it would be pytest's)
    assert "jspec generate" in command and "--json" in command

    def run(*extra, cls="cpu", user=None, drafter="ngram"):
        monkeypatch.setenv("JSPEC_MACHINE_CLASS", cls)
        if user is not None:
            monkeypatch.setenv("JSPEC_DEFAULTS", str(user))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert main([*argv, *(("--drafter", drafter) if drafter else ()), *extra]) == 0
        out, err = capsys.readouterr()
        return json.loads(out.strip().splitlines()[-1]), err, caught

    rec = check(run("--k", "3", "--dtype", "float32")[0])
    assert rec["token_ids"] == plain["token_ids"] and rec["rounds"] <= plain["rounds"]
    # With no --k / --dtype a drafter runs at the record for the machine class
    # (jspec.defaults): the shipped cpu record's float32 and k; a user record's dtype; and a
    # record saying plain decoding is faster (max_batch 0) decodes plainly, said on stderr.
    cpu = defaults.lookup("ngram", machine="cpu")
    assert cpu.dtype == "float32" and cpu.max_batch != 0
    rec, err, _ = run()
    assert check(rec)["provenance"]["machine_class"] == "cpu"
    assert "note:" not in err and rec["token_ids"] == plain["token_ids"]
    assert rec["rounds"] < rec["new_tokens"]  # it speculated (this answer repeats its prompt)
    record = tmp_path / "plain.json"
    record.write_text(json.dumps({"cpu-bf16": {"ngram": {"k": 2, "dtype": "bfloat16",
                                                         "max_batch": 0}}}))
    rec, err, caught = run(cls="cpu-bf16", user=record)
    assert rec["provenance"]["dtype"] == "bfloat16"
    assert rec["provenance"]["machine_class"] == "cpu-bf16"
    assert "note: on this cpu-bf16 machine ngram was measured slower than plain decoding" in err
    # Said once, as the note: the library's PlainDecodingWarning is not raised as well.
    assert not [w for w in caught if issubclass(w.category, jspec.PlainDecodingWarning)]
    assert rec["mean_accepted"] == 1.0
    # Plain decoding (no --drafter) on that class: its "plain" record's bfloat16 (the shipped
    # one: plain bfloat16 measured faster there), the dtype the drafters' records use too; an
    # explicit --dtype wins.
    assert defaults.plain_dtype("cpu-bf16") == "bfloat16"
    rec, err, _ = run(cls="cpu-bf16", user=tmp_path / "none.json", drafter=None)
    assert rec["provenance"]["dtype"] == "bfloat16" and "Paris" in rec["text"]
    assert rec["provenance"]["drafter"] is None and rec["mean_accepted"] == 1.0
    # The newcomer's command on the real drafter: the shipped cpu record's configuration (with
    # the proposer it names, said on stderr), greedy-identical. (--drafter-alone skips
    # `defaults.resolve`; not run again here: a second EAGLE-3 compile costs the suite ~20 s.)
    name = "smollm2-135m-eagle3"
    best = defaults.resolve(name, machine="cpu")
    rec, err, _ = run(cls="cpu", user=tmp_path / "none.json", drafter=name)
    assert check(rec)["token_ids"] == plain["token_ids"] and rec["rounds"] < rec["new_tokens"]
    assert (f"runs as {best}," in err) == (best != name)
    assert rec["provenance"]["drafter"] == best


@pytest.mark.real
@pytest.mark.slow
def test_real_generate_on_a_mesh_equals_one_device(real_model, tmp_path):
    """`--mesh 1x8` on 8 fake CPU devices (SmolLM2: 9 heads stay replicated, MLP and vocabulary
    are split 8 ways): the same greedy tokens as one device."""
    from test_sharding import eight_device_env

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "What is the capital of France?"}) + "\n")
    outs = []
    for extra in ([], ["--mesh", "1x8"]):
        proc = subprocess.run([sys.executable, "-m", "jspec", "generate", "--prompts-file", str(f),
                               "--json", "--max-new-tokens", "12", "--drafter", "ngram", *extra],
                              capture_output=True, text=True, timeout=1200, env=eight_device_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"])
    assert outs[0] == outs[1]
