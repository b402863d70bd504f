"""train/ without data: growing a drafter (--ffn keeps its function, --draft-vocab keeps its
tokens) and every flag of `python -m train` documented in --help."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_grow_ffn_keeps_the_function(kind):
    """`grow_ffn`: every layer's MLP on random inputs gives the same output after growing 32 ->
    80 units (new down rows zero, new gate/up columns not), and the gradient reaches the new
    down rows; the same width is the identity; a narrower width is refused."""
    from jspec.drafters import dflash, eagle3
    from jspec.drafters.trained import DrafterConfig
    from jspec.models.blocks import mlp
    from train.drafters import grow_ffn

    cfg = DrafterConfig(kind=kind, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8,
                        ffn_size=32, num_layers=1 if kind == "eagle3" else 2,
                        feature_layers=(0, 1, 2), draft_vocab=8, target_vocab=8,
                        rope_theta=1e4, rms_eps=1e-6, block=4, target="tiny", vat=False)
    init = eagle3.init_params if kind == "eagle3" else dflash.init_params
    p0 = init(cfg, jax.random.key(0))
    cfg1, p1 = grow_ffn(cfg, p0, 80, jax.random.key(1))
    assert cfg1.ffn_size == 80 and cfg1 == dataclasses.replace(cfg, ffn_size=80)
    layers = (lambda p: [p.layer]) if kind == "eagle3" else (lambda p: list(p.layers))
    x = jax.random.normal(jax.random.key(2), (3, 16))
    for a, b in zip(layers(p0), layers(p1), strict=True):
        assert b.w_up.shape == (16, 80) and b.w_down.shape == (80, 16)
        np.testing.assert_allclose(mlp(b, x, 1e-6), mlp(a, x, 1e-6), rtol=1e-6, atol=1e-6)
        assert np.any(np.asarray(b.w_gate[:, 32:]) != 0)
        g = jax.grad(lambda w, b=b: mlp(dataclasses.replace(b, w_down=w), x, 1e-6).sum())(
            b.w_down)
        assert np.abs(np.asarray(g[32:])).max() > 0
    same = grow_ffn(cfg, p0, 32, jax.random.key(1))
    assert same[0] is cfg and same[1] is p0
    with pytest.raises(SystemExit, match="can only grow"):
        grow_ffn(cfg, p0, 16, jax.random.key(1))


def test_draft_vocab_grows_a_kept_vocabulary_by_frequency():
    """`draft_vocab(keep=)`: the kept ids stay, the most frequent others (responses only, after
    each prompt) fill up to the size; without keep, the most frequent with EOS forced in; a
    smaller size than keep is refused."""
    from train.data import Rows, draft_vocab

    # responses: 5 x4, 6 x3, 7 x2, 8 x1 (the prompt tokens 9 do not count)
    tokens = [np.asarray([9, 9, 5, 5, 6, 7]), np.asarray([9, 5, 5, 6, 6, 7, 8])]
    rows = Rows(tokens, [2, 1], [None, None])
    np.testing.assert_array_equal(draft_vocab(rows, 2, ()), [5, 6])
    np.testing.assert_array_equal(draft_vocab(rows, 2, (8,)), [5, 8])  # EOS always in
    np.testing.assert_array_equal(draft_vocab(rows, 3, (), keep=np.asarray([8])), [5, 6, 8])
    np.testing.assert_array_equal(draft_vocab(rows, 4, (), keep=np.asarray([7, 8])), [5, 6, 7, 8])
    with pytest.raises(ValueError, match="shrink"):
        draft_vocab(rows, 1, (), keep=np.asarray([7, 8]))


def test_help_documents_every_flag(capsys):
    """Every command's --help (in this process: `python -m train` is `train.__main__.main`,
    which the subprocess tests above start)."""
    from train.__main__ import main

    for cmd in ("datagen", "eagle3", "dflash", "diversed", "d2sd", "qtemp"):
        with pytest.raises(SystemExit) as exit_:
            main([cmd, "--help"])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: python -m train {cmd}")
        for flag in ("--out", "--seed"):
            assert flag in out
