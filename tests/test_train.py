"""`python -m train` on a tiny target: datagen shards, training smoke, SIGKILL + resume, determinism."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

import jspec
from jspec.drafters.trained import load_drafter_file, to_flat
from jspec.models.cache import KVCache
from jspec.models.llama import forward
from jspec.models.loading import weights_to_hf, write_hf_dir
from train.datagen import load_shard

ROOT = Path(__file__).resolve().parent.parent


def _run(args, **kw):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A tiny target as an HF directory and datagen shards (train + held-out) made from it."""
    tmp = tmp_path_factory.mktemp("train")
    model = tiny_model("llama_tied_gqa2", seed=1)
    write_hf_dir(tmp / "target", model.config, weights_to_hf(model.config, model.weights))
    rng = np.random.default_rng(0)
    prompts = tmp / "tiny.jsonl"
    prompts.write_text("".join(json.dumps({"ids": rng.integers(2, 97, rng.integers(3, 12))
                                           .tolist()}) + "\n" for _ in range(12)))
    for split in ("train", "heldout"):
        r = _run(["datagen", "--model", str(tmp / "target"), "--out", str(tmp / "data"),
                  "--prompts-file", str(prompts), "--backend", "jax", "--feature-layers", "0",
                  "1", "2", "--max-new", "24", "--batch", "4", "--modes", "greedy", "sample",
                  "--split", split])
        assert r.returncode == 0, r.stderr[-2000:]
    return tmp, model


def test_datagen_shards_hold_the_targets_own_features(tiny_data):
    tmp, model = tiny_data
    files = sorted((tmp / "data").glob("tiny-greedy-*.npz"))
    assert len(files) == 3 and len(list((tmp / "data").glob("heldout_tiny-*.npz"))) == 6
    sh = load_shard(files[0])
    a, b = int(sh.offsets[0]), int(sh.offsets[1])
    toks, plen = sh.tokens[a:b], int(sh.prompt_lens[0])
    # Greedy rows are the target's own greedy continuation ...
    ar = jspec.generate(model, toks[None, :plen], np.asarray([plen]), max_new_tokens=24)
    n = b - a - plen
    np.testing.assert_array_equal(np.asarray(ar.tokens)[0, :n], toks[plen:])
    # ... and the features are the target's hidden states over that sequence (RMS-normalised).
    out = forward(model.config, model.weights, jnp.asarray(toks[None]),
                  jnp.arange(len(toks))[None], KVCache.create(model.config, 1, 128),
                  hidden_layers=(0, 1, 2))
    h = np.asarray(out.hidden)[:, 0]  # [3, T, D]
    h = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + 1e-6)
    f = sh.feats[a:b].astype(np.float32)
    np.testing.assert_allclose(f[:-1, :3].transpose(1, 0, 2), h[:, :-1], atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(f[:-1, 3], np.asarray(out.final_hidden)[0, :-1], atol=2e-2,
                               rtol=2e-2)


def test_token_shards_featurized_match_the_recorded_features(tiny_data):
    """`datagen --tokens-only` + `featurize` == `datagen` (greedy: the same tokens; features of
    one forward over the finished sequence == those recorded while decoding, to f16 rounding)."""
    tmp, _ = tiny_data
    prompts = tmp / "tiny.jsonl"
    r = _run(["datagen", "--model", str(tmp / "target"), "--out", str(tmp / "tok"),
              "--prompts-file", str(prompts), "--backend", "jax", "--max-new", "24",
              "--batch", "4", "--modes", "greedy", "--tokens-only"])
    assert r.returncode == 0, r.stderr[-2000:]
    r = _run(["featurize", "--tokens", str(tmp / "tok"), "--out", str(tmp / "feat"),
              "--feature-layers", "0", "1", "2", "--tokens-per-call", "64"])
    assert r.returncode == 0, r.stderr[-2000:]
    files = sorted((tmp / "data").glob("tiny-greedy-*.npz"))
    assert len(files) == 3
    for f in files:
        tok, got, want = load_shard(tmp / "tok" / f.name), load_shard(tmp / "feat" / f.name), \
            load_shard(f)
        assert tok.feats is None
        for k in ("tokens", "offsets", "prompt_lens"):
            np.testing.assert_array_equal(getattr(got, k), getattr(want, k))
        np.testing.assert_allclose(got.feats.astype(np.float32), want.feats.astype(np.float32),
                                   atol=2e-2, rtol=2e-2)
        assert np.all(got.feats[want.offsets[1:] - 1] == 0)  # never-fed last tokens
    # Resumable: a second run does nothing; a token shard refuses --dtype without --tokens-only.
    r = _run(["featurize", "--tokens", str(tmp / "tok"), "--out", str(tmp / "feat"),
              "--feature-layers", "0", "1", "2"])
    assert r.returncode == 0 and "3 already done" in r.stdout, r.stdout + r.stderr[-2000:]
    # Training on the token shards themselves is refused with the way out.
    r = _run(["eagle3", "--data", str(tmp / "tok"), "--out", str(tmp / "never"), "--steps", "1"])
    assert r.returncode != 0 and "train featurize" in r.stderr, r.stderr[-2000:]
    r = _run(["datagen", "--model", str(tmp / "target"), "--out", str(tmp / "bad"),
              "--prompts-file", str(prompts), "--dtype", "bfloat16"])
    assert r.returncode != 0 and "--tokens-only" in r.stderr


def test_torch_backend_matches_the_jax_backend(tiny_data):
    """HF transformers on the same weights (the torch backend, with and without features) gives
    the jax backend's greedy tokens and, to float16 rounding, its features. Skipped without
    torch (not in the test extra)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    tmp, _ = tiny_data
    base = ["datagen", "--model", str(tmp / "target"), "--prompts-file", str(tmp / "tiny.jsonl"),
            "--backend", "torch", "--max-new", "24", "--batch", "4", "--modes", "greedy"]
    # HF's hidden_states[L] is after the final norm: the last layer's own output is refused.
    r = _run([*base, "--out", str(tmp / "torch-bad"), "--feature-layers", "0", "1", "2"])
    assert r.returncode != 0 and "final norm" in r.stderr, r.stderr[-2000:]
    r = _run([*base, "--out", str(tmp / "torch"), "--feature-layers", "0", "1"])
    assert r.returncode == 0, r.stderr[-2000:]
    r = _run([*base, "--out", str(tmp / "torch-tok"), "--tokens-only"])
    assert r.returncode == 0, r.stderr[-2000:]
    files = sorted((tmp / "data").glob("tiny-greedy-*.npz"))
    assert len(files) == 3
    for f in files:
        want, got, tok = (load_shard(d / f.name) for d in (tmp / "data", tmp / "torch",
                                                             tmp / "torch-tok"))
        for k in ("tokens", "offsets", "prompt_lens"):
            np.testing.assert_array_equal(getattr(got, k), getattr(want, k))
            np.testing.assert_array_equal(getattr(tok, k), getattr(want, k))
        assert tok.feats is None
        np.testing.assert_allclose(got.feats.astype(np.float32),  # layers 0, 1 and final
                                   want.feats[:, [0, 1, 3]].astype(np.float32), atol=2e-2,
                                   rtol=2e-2)


TRAIN = ["--steps", "{steps}", "--ckpt-every", "2", "--eval-every", "4", "--draft-vocab", "64",
         "--batch-tokens", "128", "--seq-buckets", "64", "--ffn", "32", "--lr", "3e-3",
         "--warmup", "2"]


def _train_args(tmp, kind, out, steps, extra=()):
    args = [kind, "--model", str(tmp / "target"), "--data", str(tmp / "data"), "--out",
            str(out)] + [a.format(steps=steps) for a in TRAIN] + list(extra)
    if kind == "dflash":
        args += ["--layers", "1", "--block", "4", "--anchors", "4"]
    else:
        args += ["--positions", "8"]
    return args


def _trained(tmp, kind):
    """The run directory of a 12-step VAT training of `kind` on the tiny data (trained once
    per module)."""
    out = tmp / f"run-{kind}"
    if not (out / f"{kind}.safetensors").is_file():
        r = _run(_train_args(tmp, kind, out, 12, ["--vat"]))
        assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_training_smoke_and_loadable(tiny_data, kind):
    tmp, model = tiny_data
    out = _trained(tmp, kind)
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == list(range(1, 13))
    assert log[-1]["loss"] < log[0]["loss"]  # it learns something in 12 steps
    assert "heldout_tau_sim" in log[-1] and "heldout_tau_replay" in log[-1]
    cfg, _, vocab = load_drafter_file(out / f"{kind}.safetensors")
    assert cfg.kind == kind and cfg.vat and len(vocab) == 64
    drafter = jspec.load_drafter(str(out / f"{kind}.safetensors"), target=model)
    ids = np.asarray([[5, 6, 7, 8]], np.int32)
    ar = jspec.generate(model, ids, np.asarray([4]), max_new_tokens=12)
    sp = jspec.generate(model, ids, np.asarray([4]), max_new_tokens=12, drafter=drafter,
                        length=jspec.FixedLength(3))
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    # `qtemp` fits its q temperature on the held-out shards and writes it into a copy.
    fitted = out / "fitted.safetensors"
    r = _run(["qtemp", "--drafter", str(out / f"{kind}.safetensors"), "--model",
              str(tmp / "target"), "--data", str(tmp / "data"), "--scales", "0.5,1,2", "--out",
              str(fitted)])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {ln.split("|")[1].strip().removesuffix(" (best)"): float(ln.split("|")[3])
            for ln in r.stdout.splitlines() if ln.startswith("| ") and ln[2].isdigit()}
    assert set(rows) == {"0.5", "1", "2"} and all(1.0 <= v <= 1.0 + cfg.block for v in
                                                   rows.values()), r.stdout
    best = max(rows, key=rows.get)
    cfg2, p2, v2 = load_drafter_file(fitted)
    assert cfg2 == dataclasses.replace(cfg, q_temperature=float(best))
    np.testing.assert_array_equal(v2, vocab)
    p1 = to_flat(load_drafter_file(out / f"{kind}.safetensors")[1])
    assert all(np.array_equal(np.asarray(a), np.asarray(p1[k])) for k, a in to_flat(p2).items())


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_replayed_rounds_are_greedy_decodings_rounds(tiny_data, kind):
    """The held-out `tau_replay`: greedy decoding replayed along the target's greedy text
    (`replay_batch`) gives, row by row, the tokens and rounds `jspec.generate` counts when it
    decodes that row's prompt with the same drafter at K = the trained length; the same replay
    with every draft taken one position late (the alignment bug it could have) does not."""
    from jspec.drafters.trained import Frozen, split_frozen
    from train.data import load_rows, make_batch
    from train.drafters import drafts_along, replay_batch, replay_rounds

    tmp, model = tiny_data
    path = _trained(tmp, kind) / f"{kind}.safetensors"
    cfg, params, vocab = load_drafter_file(path)
    params, stats = split_frozen(params)
    frozen = Frozen.of(model.weights.embed, vocab, stats)
    to_draft = np.asarray(frozen.to_draft)
    greedy = tmp / "replay-data"
    greedy.mkdir(exist_ok=True)
    for f in [*(tmp / "data").glob("heldout_tiny-greedy-*.npz"), tmp / "data" / "meta.json"]:
        (greedy / f.name).write_bytes(f.read_bytes())
    layers = json.loads((greedy / "meta.json").read_text())["feature_layers"]
    rows = load_rows(str(greedy), heldout=True, layers=[layers.index(i)
                                                        for i in cfg.feature_layers])
    feat_idx = list(range(len(cfg.feature_layers)))
    k = cfg.block if kind == "eagle3" else cfg.block - 1  # chain steps / block drafts
    drafter = jspec.load_drafter(str(path), target=model)
    replayed, decoded, late = [], [], []
    for i in range(len(rows)):
        b = make_batch(rows, [i], 64, feat_idx)
        replayed.append(replay_batch(params, frozen, b, cfg))
        p, n = rows.plens[i], len(rows.tokens[i])
        out = jspec.generate(model, rows.tokens[i][None, :p], max_new_tokens=n - p,
                             drafter=drafter, length=jspec.FixedLength(k))
        np.testing.assert_array_equal(np.asarray(out.tokens[0, : n - p]), rows.tokens[i][p:])
        decoded.append((int(out.stats.emitted[0]), int(out.stats.rounds[0])))
        d = np.roll(drafts_along(params, frozen, b, cfg)[0], 1, axis=0)[:n]
        late.append(replay_rounds(to_draft[rows.tokens[i]], d, p + 1))
    assert len(rows) == 12 and replayed == decoded, (replayed, decoded)
    accepted = sum(e - r for e, r in decoded)
    assert accepted > 0  # the drafter is accepted at times: the equality is not all-rejects
    assert late != decoded


@pytest.mark.slow
def test_init_continues_from_a_trained_drafter(tiny_data):
    """`--init FILE`: the run starts from that drafter (its held-out evaluation at step 0 is the
    first run's final one, to float rounding), keeps its vocabulary and feature statistics, and
    refuses a drafter of another kind or VAT setting."""
    tmp, _ = tiny_data
    first = tmp / "init-first"
    r = _run(_train_args(tmp, "eagle3", first, 6, ["--vat", "--f32", "--eval-every", "6"]))
    assert r.returncode == 0, r.stderr[-3000:]
    src = first / "eagle3.safetensors"
    out = tmp / "init-second"
    r = _run(_train_args(tmp, "eagle3", out, 2, ["--vat", "--init", str(src), "--eval-every",
                                                 "2"]))
    assert r.returncode == 0, r.stderr[-3000:]
    a = [json.loads(x) for x in (first / "log.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in b] == [0, 1, 2]
    np.testing.assert_allclose(b[0]["heldout_loss"], a[-1]["heldout_loss"], rtol=1e-5)
    cfg0, p0, v0 = load_drafter_file(src)
    cfg1, p1, v1 = load_drafter_file(out / "eagle3.safetensors")
    assert cfg1 == cfg0 and len(v1) == 64  # the init's shape
    np.testing.assert_array_equal(v1, v0)
    for k in ("feat_mean", "feat_std"):
        np.testing.assert_allclose(np.asarray(getattr(p1, k)), np.asarray(getattr(p0, k)),
                                   rtol=1e-2)  # stored in bfloat16 by the second run
    assert not np.allclose(np.asarray(p1.fc), np.asarray(p0.fc), atol=1e-3)  # it trained
    grown = tmp / "init-grown"  # a larger --draft-vocab grows the init's vocabulary
    r = _run(_train_args(tmp, "eagle3", grown, 1, ["--vat", "--init", str(src), "--eval-every",
                                                   "0", "--draft-vocab", "80"]))
    assert r.returncode == 0, r.stderr[-3000:]
    cfg2, _, v2 = load_drafter_file(grown / "eagle3.safetensors")
    assert cfg2.draft_vocab == len(v2) == 80 and set(v0.tolist()) <= set(v2.tolist())
    np.testing.assert_array_equal(np.load(grown / "vocab.npy"), v2)
    wide = tmp / "init-wide"  # a larger --ffn grows the MLP and starts as the same function
    r = _run(_train_args(tmp, "eagle3", wide, 1, ["--vat", "--init", str(src), "--eval-every",
                                                  "1", "--ffn", "48"]))
    assert r.returncode == 0, r.stderr[-3000:]
    c = [json.loads(x) for x in (wide / "log.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(c[0]["heldout_loss"], a[-1]["heldout_loss"], rtol=1e-5)
    cfg3, p3, _ = load_drafter_file(wide / "eagle3.safetensors")
    assert cfg3 == dataclasses.replace(cfg0, ffn_size=48)
    assert p3.layer.w_gate.shape == (cfg0.hidden_size, 48) and p3.layer.w_down.shape[0] == 48
    assert np.abs(np.asarray(p3.layer.w_down[32:], np.float32)).max() > 0  # the new units train
    bad = (("eagle3", ["--init", str(src)], "pass --vat"),
           ("dflash", ["--vat", "--init", str(src)], "not dflash"),
           ("eagle3", ["--vat", "--init", str(src), "--draft-vocab", "32"], "can only grow"),
           ("eagle3", ["--vat", "--init", str(src), "--ffn", "16"], "can only grow"))
    for i, (kind, extra, msg) in enumerate(bad):
        r = _run(_train_args(tmp, kind, tmp / f"init-bad-{i}", 1, extra))
        assert r.returncode != 0 and msg in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_bfloat16_matmuls_train_the_same_steps_to_rounding(tiny_data):
    """`--matmul-dtype bfloat16`: per-step losses within 2% of float32 over 3 steps, and not
    bit-equal (the flag reaches the matmuls)."""
    tmp, _ = tiny_data
    logs = []
    for dt in ("float32", "bfloat16"):
        out = tmp / f"mm-{dt}"
        r = _run(_train_args(tmp, "eagle3", out, 3, ["--eval-every", "0", "--matmul-dtype", dt]))
        assert r.returncode == 0, r.stderr[-3000:]
        logs.append([json.loads(x)["loss"] for x in (out / "log.jsonl").read_text().splitlines()])
    np.testing.assert_allclose(logs[1], logs[0], rtol=2e-2)
    assert logs[1] != logs[0]


@pytest.mark.slow  # tests/mesh_cases.py runs a train step of each kind on 2x4 by default
def test_training_on_a_mesh_matches_one_device(tiny_data):
    """`--mesh 2x4` on 8 fake CPU devices: the same per-step losses as one device (3 steps,
    rtol 1e-4), and a loadable drafter."""
    from test_sharding import eight_device_env

    tmp, _ = tiny_data
    logs = []
    for name, extra in (("one", []), ("mesh", ["--mesh", "2x4"])):
        out = tmp / f"mesh-{name}"
        r = subprocess.run([sys.executable, "-m", "train",
                            *_train_args(tmp, "dflash", out, 3, ["--eval-every", "0", *extra])],
                           cwd=ROOT, env=eight_device_env(), capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        logs.append([json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()])
    assert "mesh {'data': 2, 'model': 4}" in r.stdout
    np.testing.assert_allclose([x["loss"] for x in logs[1]], [x["loss"] for x in logs[0]],
                               rtol=1e-4)
    load_drafter_file(tmp / "mesh-mesh" / "dflash.safetensors")
    r = _run(_train_args(tmp, "dflash", tmp / "bad", 1, ["--mesh", "3x3"]))
    assert r.returncode != 0 and "needs 9 devices" in r.stderr


def test_sigkill_then_resume_equals_uninterrupted_run(tiny_data):
    tmp, _ = tiny_data
    steps = 60
    ref = tmp / "ref"
    r = _run(_train_args(tmp, "dflash", ref, steps, ["--eval-every", "0"]))
    assert r.returncode == 0, r.stderr[-3000:]

    out = tmp / "killed"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "train",
                             *_train_args(tmp, "dflash", out, steps, ["--eval-every", "0"])],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    t0 = time.time()
    while time.time() - t0 < 300:
        ck = out / "ckpt"
        if ck.is_dir() and any(p.name.isdigit() and int(p.name) >= 4 for p in ck.iterdir()):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "dflash.safetensors").exists(), "finished before the kill: raise steps"
    done_before = max(int(p.name) for p in (out / "ckpt").iterdir() if p.name.isdigit())
    assert done_before < steps

    r = _run(_train_args(tmp, "dflash", out, steps, ["--eval-every", "0"]))
    assert r.returncode == 0, r.stderr[-3000:]
    resumed_at = int(r.stdout.split("resumed from the checkpoint at step ")[1].split()[0])
    assert resumed_at >= done_before - 2 and resumed_at >= 4
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    # The resumed run starts right after its checkpoint; no step past it is repeated twice
    # after the restart.
    after = [x["step"] for x in log][-(steps - resumed_at):]
    assert after == list(range(resumed_at + 1, steps + 1))
    p_ref = to_flat(load_drafter_file(ref / "dflash.safetensors")[1])
    p_res = to_flat(load_drafter_file(out / "dflash.safetensors")[1])
    for k in p_ref:
        np.testing.assert_allclose(np.asarray(p_res[k]), np.asarray(p_ref[k]), atol=1e-6)


def test_diversed_training_smoke_and_resume(tiny_data, tmp_path):
    """REINFORCE on the tiny target with a (random) tiny EAGLE-3 drafter; resume continues."""

    from jspec.drafters import eagle3
    from jspec.drafters.trained import DrafterConfig, save_drafter
    from jspec.verify import DiversedHead

    tmp, model = tiny_data
    c = model.config
    cfg = DrafterConfig(kind="eagle3", hidden_size=c.hidden_size, num_heads=4, num_kv_heads=2,
                        head_dim=8, ffn_size=40, num_layers=1, feature_layers=(0, 1, 2),
                        draft_vocab=64, target_vocab=c.vocab_size, rope_theta=c.rope_theta,
                        rms_eps=c.rms_eps, block=4, target="tiny")
    vocab = np.arange(64, dtype=np.int32)
    save_drafter(tmp_path / "d.safetensors", cfg, eagle3.init_params(cfg, jax.random.key(0)),
                 vocab)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"ids": [5 + i, 6, 7, 8 + i]}) + "\n" for i in range(6)))
    base = ["diversed", "--model", str(tmp / "target"), "--drafter", str(tmp_path / "d.safetensors"),
            "--prompts-file", str(prompts), "--level", "context", "--batch", "3", "--max-new", "10",
            "--k", "2", "--ckpt-every", "2", "--out", str(tmp_path / "run"), "--lr", "0.5"]
    r = _run([*base, "--steps", "4"])
    assert r.returncode == 0, r.stderr[-3000:]
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2, 3, 4]
    assert all(0.0 <= x["reward"] <= 1.0 and 0.0 < x["w"] < 1.0 for x in log)
    head = DiversedHead.load(tmp_path / "run" / "diversed.safetensors")
    assert head.kind == "context" and head.d_target == c.hidden_size
    # The regulariser alone moves w below its initial 0.5 (it raises acceptance).
    assert np.abs(np.asarray(head.bias)).sum() > 0
    r = _run([*base, "--steps", "6"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from the checkpoint at step 4" in r.stdout
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2, 3, 4, 5, 6]


def test_d2sd_training_smoke_resume_and_loadable(tiny_data, tmp_path):
    """`train d2sd` fine-tunes a (random, tiny) DFlash into the variable-prefix drafter: the
    loss falls, held-out metrics are logged (also at step 0), a rerun with more steps resumes,
    the result loads as a D²SD tree drafter and keeps greedy output identical."""

    from jspec.drafters import d2sd, dflash
    from jspec.drafters.trained import DrafterConfig, save_drafter

    tmp, model = tiny_data
    c = model.config
    cfg = DrafterConfig(kind="dflash", hidden_size=c.hidden_size, num_heads=4, num_kv_heads=2,
                        head_dim=8, ffn_size=32, num_layers=1, feature_layers=(1, 2),
                        draft_vocab=64, target_vocab=c.vocab_size, rope_theta=c.rope_theta,
                        rms_eps=c.rms_eps, block=4, target="tiny")
    first = tmp_path / "first.safetensors"
    save_drafter(first, cfg, dflash.init_params(cfg, jax.random.key(0)),
                 np.arange(2, 66, dtype=np.int32), dtype="float32")
    out = tmp_path / "run"
    base = ["d2sd", "--init", str(first), "--model", str(tmp / "target"), "--data",
            str(tmp / "data"), "--out", str(out), "--batch-tokens", "128", "--seq-buckets", "64",
            "--anchors", "4", "--ckpt-every", "2", "--eval-every", "4", "--lr", "3e-3",
            "--warmup", "2", "--f32"]
    r = _run([*base, "--steps", "6"])
    assert r.returncode == 0, r.stderr[-3000:]
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == list(range(7))
    assert "heldout_tau_sim" in log[0] and "heldout_tau_sim" in log[-1]
    # Same held-out blocks at step 0 and at the end: it learns something in 6 steps.
    assert log[-1]["heldout_loss"] < log[0]["heldout_loss"]
    r = _run([*base, "--steps", "8"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from the checkpoint at step 6" in r.stdout
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == list(range(9))
    cfg2, _, vocab = load_drafter_file(out / "d2sd.safetensors")
    assert cfg2.kind == "d2sd" and cfg2.block == 4 and len(vocab) == 64
    drafter = jspec.load_drafter(str(out / "d2sd.safetensors"), target=model)
    assert isinstance(drafter, d2sd.D2SD)
    ids = np.asarray([[5, 6, 7, 8]], np.int32)
    ar = jspec.generate(model, ids, np.asarray([4]), max_new_tokens=12)
    sp = jspec.generate(model, ids, np.asarray([4]), max_new_tokens=12, drafter=drafter,
                        length=jspec.FixedLength(3))
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
