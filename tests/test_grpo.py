"""`python -m train grpo` (issue 58 item 7): the on-device reward reads answers as
`jspec.tasks.math_correct` does; the jitted RL step compiles once, its recomputed log-probs
equal the rollout's, it changes the parameters; a resumed run reproduces the uninterrupted one."""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

import jspec
from jspec.tasks import last_number, math_correct
from train import grpo
from train.grpo_tasks import OTHER, Tasks, answer_reward, token_classes

CHARS = list("0123456789,.- abcx=")


class CharTokenizer:
    """One token per character ("Ġ" for a space, as byte-level BPE vocabularies write it)."""

    def get_vocab(self) -> dict[str, int]:
        return {c.replace(" ", "Ġ"): i + 2 for i, c in enumerate(CHARS)}


def test_device_reward_reads_the_last_number_as_math_correct_does():
    texts = ["42", " 42", "x = 42.", "1,000", "-42", "4-2", "42.0", "42.5", "42.00", "4 2",
             "b42a", "42, 1", "12,", "1.5.42", "", "abc", "- 42", "042", "99999999999"]
    answers = [42, 42, 42, 1000, 42, 2, 42, 42, 42, 2, 42, 1, 12, 42, 0, 0, 42, 42, 99999999]
    vocab = CharTokenizer().get_vocab()
    n = max(map(len, texts)) + 1
    toks = np.full((len(texts), n), -1, np.int32)
    for r, t in enumerate(texts):
        toks[r, :len(t)] = [vocab[c.replace(" ", "Ġ")] for c in t]
        toks[r, len(t)] = 1  # EOS
    cls = token_classes(CharTokenizer(), 32)
    got = np.asarray(answer_reward(jnp.asarray(toks), jnp.asarray(answers), jnp.asarray(cls)))
    want = [float(math_correct(str(a), t)) for a, t in zip(answers, texts, strict=True)]
    np.testing.assert_array_equal(got, want)
    assert sum(want) >= 8  # both outcomes are exercised


def _setup(rebind: bool = True):
    model = tiny_model("llama_tied_gqa2")
    rng = np.random.default_rng(0)
    ids = rng.integers(20, 90, (6, 8)).astype(np.int32)
    tasks = Tasks(ids, np.asarray([8, 5, 6, 7, 8, 4], np.int32),
                  np.asarray([3, 7, 1, 0, 5, 9], np.int32), ("t",) * 6)
    # a third of the tokens read as digits, so sampled completions often end in a number
    ids_ = np.arange(model.config.vocab_size)
    cls = np.where(ids_ % 3 == 0, ids_ % 10, OTHER).astype(np.int32)
    cfg = grpo.GRPOConfig(prompts=2, group=4, max_new_tokens=6, temperature=2.0, k=2,
                          rebind=rebind)
    drafter = jspec.load_drafter("early-exit:1", target=model)
    return model, drafter, tasks, cls, cfg


def _args(tmp, steps, stop_after=0):
    return argparse.Namespace(lr=1e-2, warmup=0, steps=steps, clip=1.0, weight_decay=0.0,
                              train_layers=1, seed=3, ckpt_every=1, stop_after=stop_after)


def _answer_some_group(model, drafter, cfg, cls, batch, key):
    """The batch with one group's answer set to the number one of its rows (but not all) will
    end with, read from the same rollout run outside the step: a nonzero advantage."""
    out = jspec.generate(model, batch.ids, batch.lens, drafter=jspec.bind(drafter, model.weights),
                         max_new_tokens=cfg.max_new_tokens, key=key,
                         sampling=jspec.Sampling(temperature=cfg.temperature),
                         length=jspec.FixedLength(cfg.k))
    toks = np.asarray(out.tokens)
    nums = [last_number("".join(str(cls[x]) if x >= 0 and cls[x] <= 9 else "a" for x in row))
            for row in toks]
    answers = np.asarray(batch.answers).copy()
    for r, s in enumerate(nums):
        group = nums[r - r % cfg.group: r - r % cfg.group + cfg.group]
        if s is not None and s == str(int(s)) and int(s) < 10 ** 8 and group.count(s) < len(group):
            answers[r - r % cfg.group: r - r % cfg.group + cfg.group] = int(s)
            return dataclasses.replace(batch, answers=jnp.asarray(answers))
    raise AssertionError(f"no group with a mixed outcome: {nums}")


def test_rl_step_compiles_once_and_updates_the_policy():
    model, drafter, tasks, cls, cfg = _setup()
    args = _args(None, 2)
    frozen, params = grpo.split_policy(model.weights, args.train_layers)
    policy = dataclasses.replace(model, config=model.config.replace(tie_embeddings=False),
                                 weights=grpo.merge(frozen, params))
    np.testing.assert_array_equal(np.asarray(policy.weights.lm_head),
                                  np.asarray(model.weights.embed).T)
    tx = grpo.optimizer(args)
    params, opt_state = grpo.init_state(params, drafter, tx, None)
    step = grpo.make_step(cfg, policy.config, tx)
    before = jax.tree.map(np.array, params)  # copies: params are donated
    batch, key = grpo.step_batch(tasks, cfg, args.seed, 0)
    batch = _answer_some_group(policy, drafter, cfg, cls, batch, key)
    params, opt_state, m, tokens = step(frozen, params, opt_state, drafter, batch,
                                        jnp.asarray(cls), key)
    assert 0 < float(m["reward"]) < 1 and float(m["grad_norm"]) > 0
    assert params["drafter"] is None and "drafter_loss" not in m
    moved = [not np.array_equal(a, np.asarray(b)) for a, b in
             zip(jax.tree.leaves(before), jax.tree.leaves(params), strict=True)]
    assert all(moved)
    for i in (0, 1):
        batch, key = grpo.step_batch(tasks, cfg, args.seed, i)
        params, opt_state, m, tokens = step(frozen, params, opt_state, drafter, batch,
                                            jnp.asarray(cls), key)
        assert np.isfinite(float(m["loss"])) and 0 <= float(m["reward"]) <= 1
        # the teacher-forced log-probs equal the rollout's: the ratio is 1 at the update
        assert float(m["ratio_dev"]) < 1e-4, float(m["ratio_dev"])
        assert float(m["tau"]) >= 1.0 and tokens.shape == (8, 6)
    assert step._cache_size() == 1


def test_resumed_run_reproduces_the_uninterrupted_one(tmp_path):
    model, drafter, tasks, cls, cfg = _setup()
    whole, _, end = grpo.train(model, drafter, tasks, cls, cfg, _args(tmp_path, 3),
                               tmp_path / "whole")
    assert end == 3
    _, _, stopped = grpo.train(model, drafter, tasks, cls, cfg, _args(tmp_path, 3, 2),
                               tmp_path / "parts")
    assert stopped == 2
    resumed, _, end = grpo.train(model, drafter, tasks, cls, cfg, _args(tmp_path, 3),
                                 tmp_path / "parts")
    assert end == 3
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_real_model_step(tmp_path):
    """One RL step on SmolLM2-135M-Instruct with the shipped EAGLE-3 drafter: rollout log-probs
    match the recomputation, the device reward equals the host check."""
    from train.grpo_tasks import arithmetic_tasks

    model = jspec.load_model("smollm2-135m")
    drafter = jspec.load_drafter("smollm2-135m-eagle3", target=model, best=True)
    tasks = arithmetic_tasks(model, 40)
    cls = token_classes(model.tokenizer, model.config.vocab_size)
    cfg = grpo.GRPOConfig(prompts=2, group=4, max_new_tokens=6, k=2)
    args = argparse.Namespace(lr=1e-5, warmup=0, steps=1, clip=1.0, weight_decay=0.0,
                              train_layers=1, seed=0, ckpt_every=1, stop_after=0)
    frozen, params = grpo.split_policy(model.weights, 1)
    tx = grpo.optimizer(args)
    step = grpo.make_step(cfg, model.config.replace(tie_embeddings=False), tx)
    batch, key = grpo.step_batch(tasks, cfg, 0, 0)
    _, _, m, tokens = step(frozen, params, tx.init(params), drafter, batch, jnp.asarray(cls),
                           key)
    assert float(m["ratio_dev"]) < 1e-3 and np.isfinite(float(m["loss"]))
    host = np.mean([math_correct(str(a), model.decode(t)) for a, t in
                    zip(np.asarray(batch.answers), np.asarray(tokens), strict=True)])
    assert float(m["reward"]) == pytest.approx(host)


def test_online_drafter_step_trains_the_drafter_inside_the_rl_step():
    """--drafter-lr: the RL step also trains its EAGLE-3 drafter (inside an +ngram proposer) on
    the rollout's features: the drafter's parameters move, its loss is finite, the policy's
    log-probs still match, one compile."""
    import optax
    from test_rl import _build

    from jspec.drafters.ngram import LookupFirst

    model, _, tasks, cls, cfg = _setup()
    args = _args(None, 3)
    frozen, params = grpo.split_policy(model.weights, args.train_layers)
    policy = dataclasses.replace(model, config=model.config.replace(tie_embeddings=False),
                                 weights=grpo.merge(frozen, params))
    inner = _build("eagle3", model.weights, model.name)
    drafter = LookupFirst(inner=inner)
    assert grpo.trained_part(drafter) is inner
    assert grpo.with_trained_part(drafter, inner) == drafter
    tx, dtx = grpo.optimizer(args), optax.adam(1e-2)
    state, opt = grpo.init_state(params, drafter, tx, dtx)
    before = jax.tree.map(np.array, state["drafter"])
    step = grpo.make_step(cfg, policy.config, tx, dtx)
    for i in range(3):
        batch, key = grpo.step_batch(tasks, cfg, args.seed, i)
        state, opt, m, _ = step(frozen, state, opt, drafter, batch, jnp.asarray(cls), key)
        assert np.isfinite(float(m["drafter_loss"])) and float(m["ratio_dev"]) < 1e-4
    assert step._cache_size() == 1
    moved = [not np.array_equal(a, np.asarray(b)) for a, b in
             zip(jax.tree.leaves(before), jax.tree.leaves(state["drafter"]), strict=True)]
    assert any(moved)


def test_held_out_tasks_exclude_the_training_expressions():
    from train.grpo_bench import held_out

    def tasks(texts):
        n = len(texts)
        return Tasks(np.arange(n)[:, None], np.ones(n, np.int32), np.arange(n), tuple(texts))

    got = held_out(tasks(["1 + 2", "3 * 4"]), tasks(["3 * 4", "5 - 1", "1 + 2", "6 * 7"]), 2)
    assert got.texts == ("5 - 1", "6 * 7") and list(got.answers) == [1, 3]
    with pytest.raises(SystemExit, match="only 2 held-out"):
        held_out(tasks(["1 + 2"]), tasks(["1 + 2", "5 - 1", "6 * 7"]), 3)


def test_online_state_checkpoints_and_restores(tmp_path):
    """An online run's checkpoint holds the drafter it trained: `grpo_bench.restore` gives back
    the policy and the drafter (inside its proposer) as `train` returned them."""
    from test_rl import _build

    from jspec.drafters.ngram import LookupFirst
    from train.grpo_bench import restore

    model, _, tasks, cls, cfg = _setup()
    drafter = LookupFirst(inner=_build("eagle3", model.weights, model.name))
    args = _args(tmp_path, 1)
    args.drafter_lr, args.out = 1e-2, str(tmp_path / "run")
    state, _, end = grpo.train(model, drafter, tasks, cls, cfg, args, tmp_path / "run")
    assert end == 1
    step, policy, got = restore(model, drafter, args)
    assert step == 1 and isinstance(got, LookupFirst)
    for a, b in zip(jax.tree.leaves((state["policy"], state["drafter"])),
                    jax.tree.leaves((policy, got.inner.params)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
        jax.tree.leaves(drafter.inner.params), jax.tree.leaves(got.inner.params), strict=True))
