"""train.step (issue 58 item 6): a trained drafter's optimizer step as a pure function of a
`generate(features=True)` rollout, inside the same jit as the rollout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import pad_prompts, tiny_model
from test_rl import PROMPTS, TOP_P, _build

import jspec


@pytest.mark.parametrize("kind", ["eagle3", pytest.param("dflash", marks=pytest.mark.slow)])
def test_drafter_trains_on_its_rollout_inside_one_jit(kind):
    """generate(features=True) -> train.step.drafter_step in one jitted function: repeated on
    one rollout, the step lowers the drafter's loss (the CLI's loss and optax update); the
    updated drafter comes back as a drafter that decodes; no recompile across steps."""
    import optax

    from train.step import drafter_step, init_opt

    model = tiny_model()
    ids, lens = pad_prompts(PROMPTS)
    tx = optax.adam(3e-3)

    @jax.jit
    def step(drafter, opt, key):
        out = jspec.generate(model, ids, lens, max_new_tokens=12, sampling=TOP_P, key=key,
                             drafter=drafter, length=jspec.FixedLength(3), features=True)
        drafter, opt, metrics = drafter_step(drafter, opt, out, jnp.asarray(lens), key, tx=tx,
                                             positions=4)
        return drafter, opt, metrics["loss"]

    d = _build(kind, model.weights, model.name)
    opt = init_opt(d, tx)
    losses = []
    for _ in range(4):
        d, opt, loss = step(d, opt, jax.random.key(0))
        losses.append(float(loss))
    assert step._cache_size() == 1
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
