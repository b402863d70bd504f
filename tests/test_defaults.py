"""Measured-best defaults per drafter (`jspec.defaults`): records, lookup order, and what
`load_drafter` / `generate` / the CLI take from them."""

from __future__ import annotations

import dataclasses
import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

import jspec
from jspec import defaults, provenance
from jspec.drafters.loading import SHIPPED, WRAPPERS
from jspec.drafters.ngram import LookupFirst
from jspec.errors import JspecError
from jspec.specs import split_spec


@pytest.mark.parametrize("spec, key", [
    ("ngram", "ngram"), ("ngram:n=4", "ngram"),
    ("smollm2-135m-eagle3:cut=0.5", "smollm2-135m-eagle3"),
    ("smollm2-135m-eagle3+topk:k=2,nodes=6", "smollm2-135m-eagle3+topk"),
    ("early-exit:6", "early-exit")])
def test_base_name(spec, key):
    assert defaults.base_name(spec) == key


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Tests of the shipped records run as on the class they were first measured on."""
    monkeypatch.setenv("JSPEC_MACHINE_CLASS", "cpu-bf16")


def test_shipped_records_are_valid_and_name_shipped_drafters():
    data = defaults.read(defaults.SHIPPED)  # checks the classes
    assert {"cpu", "cpu-bf16"} <= set(data), "both CPU classes have measured records"
    for cls, table in data.items():
        for name, raw in table.items():
            assert defaults.base_name(name).split("+")[0] in (*SHIPPED, "ngram",
                                                              defaults.PLAIN), name
            rec = defaults.Record(**raw)
            assert rec.source, f"{cls}/{name}: a shipped record says where it was measured"
            if rec.proposer:  # a proposer `load_drafter` knows, measured in the named run
                assert split_spec(rec.proposer)[0] in WRAPPERS, (cls, name)
                assert "--proposers" in rec.source, (cls, name)
    # The newcomer's first command (`generate --drafter smollm2-135m-eagle3`) has a record on
    # both CPU classes, and each dtype is the one measured faster on that class.
    for cls, dtype in (("cpu", "float32"), ("cpu-bf16", "bfloat16")):
        assert defaults.lookup("smollm2-135m-eagle3", machine=cls).dtype == dtype, cls
        # ... and plain decoding's record agrees: `generate` with and without --drafter
        # decodes in the same dtype.
        assert defaults.plain_dtype(cls) == dtype, cls


@pytest.mark.parametrize("flags, cls", [
    ({"avx2", "fma"}, "cpu"), ({"avx2", "avx512f", "avx512_bf16"}, "cpu-bf16"),
    ({"avx512f", "amx_bf16", "amx_tile"}, "cpu-bf16"), ({"fp", "asimd", "bf16"}, "cpu-bf16"),
    (set(), "cpu")])
def test_machine_class_from_the_cpu_flags(monkeypatch, flags, cls):
    monkeypatch.delenv("JSPEC_MACHINE_CLASS", raising=False)
    monkeypatch.setattr(provenance, "cpu_flags", lambda: frozenset(flags))
    assert provenance.machine_class() == cls  # this test process runs JAX on the CPU
    monkeypatch.setenv("JSPEC_MACHINE_CLASS", "tpu")
    assert provenance.machine_class() == "tpu"
    monkeypatch.setenv("JSPEC_MACHINE_CLASS", "h200")
    with pytest.raises(JspecError, match="JSPEC_MACHINE_CLASS must be one of"):
        provenance.machine_class()


def test_records_are_per_machine_class(tmp_path, monkeypatch):
    """A record saved on one class is not used on another; each class falls back to its own
    shipped record, and a class with neither has none."""
    monkeypatch.setenv("JSPEC_DEFAULTS", str(tmp_path / "d.json"))
    monkeypatch.setenv("JSPEC_MACHINE_CLASS", "cpu")
    other = defaults.lookup("ngram", machine="cpu-bf16")
    assert other is not None and other.k != 9
    defaults.save("ngram", defaults.Record(k=9, dtype="float32", source="t"))
    assert defaults.lookup("ngram").k == 9
    assert defaults.lookup("ngram", machine="cpu-bf16") == other
    monkeypatch.setenv("JSPEC_MACHINE_CLASS", "tpu")
    assert defaults.lookup("ngram") is None
    saved = json.loads((tmp_path / "d.json").read_text())
    assert set(saved) == {"cpu"} and saved["cpu"]["ngram"]["k"] == 9


def test_user_record_overrides_shipped_and_save_keeps_others(tmp_path, monkeypatch, cpu_bf16):
    path = tmp_path / "d.json"
    monkeypatch.setenv("JSPEC_DEFAULTS", str(path))
    shipped = defaults.lookup("smollm2-135m-eagle3")
    assert shipped is not None and shipped.dtype in defaults.DTYPES
    assert defaults.lookup("ngram:n=2") == defaults.lookup("ngram")
    defaults.save("ngram:n=4", defaults.Record(k=7, dtype="float32", source="test"))
    defaults.save("smollm2-135m-eagle3", defaults.Record(k=2, dtype="float32", source="t"))
    assert defaults.lookup("ngram").k == 7
    assert defaults.lookup("smollm2-135m-eagle3").k == 2
    assert defaults.lookup("no-such-drafter") is None


@pytest.mark.parametrize("text, match", [
    ("[1, 2]", "JSON object"), ("{bad", "cannot read"),
    ('{"cpu": {"ngram": {"k": 0, "dtype": "float32"}}}', "k must be"),
    ('{"cpu": {"ngram": {"k": 3, "dtype": "float16"}}}', "dtype must be"),
    ('{"cpu": {"ngram": {"k": 3, "dtype": "float32", "max_batch": -1}}}', "max_batch must be"),
    ('{"cpu": {"ngram": {"k": 3, "speed": 2}}}', "must be an object"),
    ('{"cpu": {"ngram": {"k": 3, "proposer": "topk+ngram"}}}', "one proposer spec"),
    ('{"cpu": {"ngram": {"k": 3, "proposer": 1}}}', "one proposer spec"),
    ('{"h200": {}}', "maps machine classes"),
    ('{"cpu": [1]}', "maps machine classes"),
    ('{"ngram": {"k": 3, "dtype": "float32"}}', "older jspec")])
def test_bad_user_file_is_a_clear_error(tmp_path, monkeypatch, text, match):
    path = tmp_path / "d.json"
    path.write_text(text)
    monkeypatch.setenv("JSPEC_DEFAULTS", str(path))
    monkeypatch.setenv("JSPEC_MACHINE_CLASS", "cpu")
    with pytest.raises(JspecError, match=match):
        defaults.lookup("ngram")


def test_generate_without_length_uses_the_drafters_recorded_k(tmp_path, monkeypatch, cpu_bf16):
    """A record's k reaches the drafter's `settings.k` through load_drafter (shipped, then the user's
    overriding it), and `generate` with no length= verifies that many drafted tokens per round
    (Stats.accepted_at has one column per drafted position); an explicit length= still wins;
    a drafter without a record keeps k = 5."""
    model = tiny_model()
    ids = jnp.asarray([[5, 6, 7, 5, 6, 7, 5, 6]], jnp.int32)
    monkeypatch.setenv("JSPEC_DEFAULTS", str(tmp_path / "d.json"))
    plain = jspec.generate(model, ids, max_new_tokens=8)
    early = jspec.load_drafter("early-exit:1", target=model)
    assert defaults.lookup("early-exit:1") is None and early.settings.k == 5
    assert jspec.generate(model, ids, drafter=early,
                          max_new_tokens=8).stats.accepted_at.shape == (1, 5)
    shipped = defaults.lookup("ngram").k
    assert jspec.load_drafter("ngram", target=model).settings.k == shipped
    user_k = 2 if shipped != 2 else 4
    defaults.save("ngram", defaults.Record(k=user_k, dtype="float32", source="test"))
    d = jspec.load_drafter("ngram:n=2", target=model)
    assert d.settings.k == user_k
    out = jspec.generate(model, ids, drafter=d, max_new_tokens=8)
    assert out.stats.accepted_at.shape == (1, user_k)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    assert jspec.generate(model, ids, drafter=d, max_new_tokens=8,
                          length=jspec.FixedLength(1)).stats.accepted_at.shape == (1, 1)
    tree = jspec.load_drafter("ngram+topk:k=2,nodes=4", target=model)
    assert tree.settings.k == user_k  # a proposer without its own record keeps the inner's


def test_generate_decodes_plainly_past_the_recorded_batch(tmp_path, monkeypatch, cpu_bf16):
    """A record's max_batch = 2 reaches `settings.max_batch` (also through a +topk proposer); with
    no length= a batch of 3 is decoded plainly (nothing drafted, the same greedy tokens), a
    batch of 2 speculates, and an explicit length= or a relaxed verifier keeps speculating."""
    model = tiny_model()
    monkeypatch.setenv("JSPEC_DEFAULTS", str(tmp_path / "d.json"))
    defaults.save("ngram", defaults.Record(k=2, dtype="float32", source="t", max_batch=2))
    d = jspec.load_drafter("ngram", target=model)
    assert d.settings.max_batch == 2
    assert jspec.load_drafter("ngram+topk:k=2,nodes=4", target=model).settings.max_batch == 2
    ids = jnp.asarray([[5, 6, 7, 5, 6, 7, 5, 6]] * 3, jnp.int32)

    def drafted(out):
        return int(np.sum(np.asarray(out.stats.drafted)))

    plain = jspec.generate(model, ids, max_new_tokens=8)
    # The fallback is never silent: a PlainDecodingWarning names the limit and the way out.
    with pytest.warns(jspec.PlainDecodingWarning, match="past batch 2.*FixedLength"):
        auto = jspec.generate(model, ids, drafter=d, max_new_tokens=8)
    assert drafted(auto) == 0
    with pytest.warns(jspec.PlainDecodingWarning):
        assert drafted(jspec.generate(model, ids, drafter=d, max_new_tokens=8,
                                      verifier=jspec.Lossless())) == 0
    np.testing.assert_array_equal(np.asarray(auto.tokens), np.asarray(plain.tokens))
    with warnings.catch_warnings():  # speculating: no warning
        warnings.simplefilter("error", jspec.PlainDecodingWarning)
        assert drafted(jspec.generate(model, ids[:2], drafter=d, max_new_tokens=8)) > 0
    forced = jspec.generate(model, ids, drafter=d, max_new_tokens=8, length=jspec.FixedLength(2))
    assert drafted(forced) > 0
    np.testing.assert_array_equal(np.asarray(forced.tokens), np.asarray(plain.tokens))
    relaxed = jspec.generate(model, ids, drafter=d, max_new_tokens=8, verifier=jspec.ASD())
    assert drafted(relaxed) > 0
    unlimited = dataclasses.replace(d, max_batch=None)
    assert drafted(jspec.generate(model, ids, drafter=unlimited, max_new_tokens=8)) > 0
    # max_batch 0 (measured slower than plain decoding even at batch 1): plain at every batch.
    never = dataclasses.replace(d, max_batch=0)
    with pytest.warns(jspec.PlainDecodingWarning, match="at every batch size"):
        one = jspec.generate(model, ids[:1], drafter=never, max_new_tokens=8)
    assert drafted(one) == 0
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(plain.tokens[:1]))
    assert drafted(jspec.generate(model, ids[:1], drafter=never, max_new_tokens=8,
                                  length=jspec.FixedLength(2))) > 0


@pytest.mark.parametrize("faster, prior, limit", [
    (False, None, 0), (False, 4, 0), (True, None, None), (True, 4, 4), (True, 0, None)])
def test_calibrate_records_the_batch_limit_it_measured(faster, prior, limit):
    from jspec.calibrate_defaults import batch_limit

    rec = None if prior is None else defaults.Record(k=3, source="t", max_batch=prior)
    assert batch_limit(faster, rec) == limit


@pytest.mark.parametrize("argv, match", [
    (["--ks", "2,x"], "--ks"), (["--ks", "0"], "--ks"), (["--dtypes", "float16"], "--dtypes")])
def test_calibrate_refuses_bad_arguments_before_loading(argv, match, capsys):
    from jspec.cli import main

    assert main(["calibrate", "--drafter", "ngram", *argv]) == 2
    assert match in capsys.readouterr().err


def test_a_record_names_the_proposer_of_the_best_configuration(tmp_path, monkeypatch):
    """A record's proposer: `resolve` wraps a bare spec in it (a spec naming its own proposer
    is left alone), `load_drafter(best=True)` loads that configuration with the record's k, a
    plain `load_drafter` the drafter alone; `save` writes it only when there is one."""
    path = tmp_path / "d.json"
    monkeypatch.setenv("JSPEC_DEFAULTS", str(path))
    monkeypatch.setenv("JSPEC_MACHINE_CLASS", "tpu")  # no shipped records on this class
    model = tiny_model()
    assert defaults.resolve("early-exit:1") == "early-exit:1"
    defaults.save("early-exit:1", defaults.Record(k=3, source="t"))
    assert "proposer" not in json.loads(path.read_text())["tpu"]["early-exit"]
    assert defaults.resolve("early-exit:1") == "early-exit:1"
    assert not isinstance(jspec.load_drafter("early-exit:1", target=model, best=True),
                          LookupFirst)
    defaults.save("early-exit:1", defaults.Record(k=3, source="t", proposer="ngram:n_min=3"))
    assert defaults.resolve("early-exit:1") == "early-exit:1+ngram:n_min=3"
    assert defaults.resolve("early-exit:1+topk") == "early-exit:1+topk"
    assert defaults.resolve("early-exit:1", machine="cpu") == "early-exit:1"  # per class
    best = jspec.load_drafter("early-exit:1", target=model, best=True)
    assert isinstance(best, LookupFirst) and best.n_min == 3 and best.settings.k == 3
    alone = jspec.load_drafter("early-exit:1", target=model)
    assert not isinstance(alone, LookupFirst) and alone.settings.k == 3
    ids = jnp.asarray([[5, 6, 7, 5, 6, 7, 5, 6]], jnp.int32)
    out = jspec.generate(model, ids, drafter=best, max_new_tokens=8)
    assert out.stats.accepted_at.shape == (1, 3)  # the record's k, no length= given
    np.testing.assert_array_equal(np.asarray(out.tokens),
                                  np.asarray(jspec.generate(model, ids, max_new_tokens=8).tokens))


def test_the_cli_applies_a_records_proposer_only_where_it_was_measured():
    """Lossless verification of chains (fixed K, or no length given): the configuration a
    record's proposer was measured in. Relaxed verifiers and LibraSpec get the drafter alone
    (a looked-up chain has no hidden states or block extension for them)."""
    from jspec.cli import default_proposer_applies
    from jspec.length import parse_length

    lossless = jspec.Lossless()
    assert default_proposer_applies(lossless, None)
    assert default_proposer_applies(lossless, jspec.FixedLength(3))
    assert not default_proposer_applies(lossless, parse_length("libraspec"))
    assert not default_proposer_applies(jspec.ASD(), None)
    assert not default_proposer_applies(jspec.Diversed(weight=0.5), None)


def test_calibrate_tries_the_recorded_proposer_against_the_drafter_alone(tmp_path, monkeypatch):
    from jspec.calibrate_defaults import proposers_to_try

    monkeypatch.setenv("JSPEC_DEFAULTS", str(tmp_path / "d.json"))
    monkeypatch.setenv("JSPEC_MACHINE_CLASS", "tpu")
    assert proposers_to_try(None, "early-exit:1") == [""]
    defaults.save("early-exit:1", defaults.Record(k=3, source="t", proposer="ngram"))
    assert proposers_to_try(None, "early-exit:1") == ["", "ngram"]
    assert proposers_to_try("none,ngram:n_min=3,none", "x") == ["", "ngram:n_min=3"]
    for bad in ("", "topk+ngram"):
        with pytest.raises(JspecError, match="--proposers"):
            proposers_to_try(bad, "x")
    with pytest.raises(JspecError, match="names its proposer"):
        proposers_to_try("ngram", "x+topk")


def test_capabilities_say_what_a_drafter_is_and_settings_what_was_measured():
    """`Capabilities` holds no measured value; `settings_of` reads the settings a drafter
    carries (a proposer's own where set, else its inner drafter's) and gives any other
    `Drafter` implementation the defaults (k = 5, no batch limit)."""
    from jspec.drafters.base import Capabilities, settings_of
    from jspec.drafters.ngram import NGram

    assert not {"default_k", "max_batch"} & {f.name for f in dataclasses.fields(Capabilities)}
    inner = NGram(default_k=3, max_batch=2)
    assert settings_of(inner) == defaults.Settings(k=3, max_batch=2)
    assert settings_of(LookupFirst(inner)) == defaults.Settings(k=3, max_batch=2)
    assert settings_of(LookupFirst(inner, default_k=4, max_batch=None)) == defaults.Settings(4)

    class Bare:  # the protocol only
        caps = Capabilities()

        def init_state(self, *a, **kw): ...

        def draft(self, *a, **kw): ...

        def observe(self, *a, **kw): ...

    assert isinstance(Bare(), jspec.drafters.base.Drafter)
    assert settings_of(Bare()) == defaults.Settings(k=5, max_batch=None)
