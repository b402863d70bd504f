"""`jspec.memory`: the estimate tracks XLA's plan, and a batch that cannot fit is a clear error
before it runs (with the largest batch that would), while one that fits runs."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import tiny_model

import jspec
from jspec import decode, memory
from jspec.drafters import NGram
from jspec.inputs import pad_to_bucket


def _xla_bytes(model, b, new, drafter=None):
    ids = pad_to_bucket(np.ones((b, 5), np.int32))
    st = decode._statics(model, ids, drafter, jspec.Sampling(), new, None, None, None)
    ver = st.pop("verifier")
    m = decode._generate.lower(model.weights, drafter, ver, ids, np.full((b,), 5, np.int32),
                               jax.random.key(0), **st).compile().memory_analysis()
    est = memory.estimate_bytes(model.config, b, st["capacity"], st["k"], ids.shape[1], drafter)
    return m.temp_size_in_bytes + m.output_size_in_bytes, est


@pytest.mark.parametrize("b", [4, 32])
def test_estimate_tracks_xla_plan(b):
    """Within a factor of 3 of XLA's temporaries + outputs (it is a planning estimate)."""
    model = tiny_model()
    for drafter in (None, NGram()):
        xla, est = _xla_bytes(model, b, 16, drafter)
        assert xla / 3 <= est <= 3 * xla, (b, drafter, xla, est)


def test_batch_that_cannot_fit_is_a_clear_error(monkeypatch):
    model = tiny_model()
    ids = np.ones((8, 5), np.int32)
    # Control: with the machine's real free memory the batch runs.
    out = jspec.generate(model, ids, max_new_tokens=4)
    assert np.asarray(out.lengths).shape == (8,)
    # Broken: pretend 64 KiB are free. The estimate passes half of it, XLA's plan is read, and
    # the error names the need and the largest batch that would fit.
    monkeypatch.setattr(memory, "free_bytes", lambda device=None: 64 * 1024)
    with pytest.raises(jspec.JspecError, match=r"batch 8 needs .* largest batch that would: "
                                               r"about \d+"):
        jspec.generate(model, ids, max_new_tokens=4)
    # The estimate alone (no compile) decides when asked to.
    monkeypatch.setenv("JSPEC_MEMORY_CHECK", "0")
    with pytest.raises(jspec.JspecError, match="would not fit"):
        jspec.generate(model, ids, max_new_tokens=4)


def test_no_check_inside_a_users_jit():
    """Under an outer jit the inputs are tracers: no check (and no error), the program runs."""
    model = tiny_model()
    f = jax.jit(lambda ids: jspec.generate(model, ids, max_new_tokens=3).tokens)
    assert f(np.ones((2, 5), np.int32)).shape == (2, 3)
