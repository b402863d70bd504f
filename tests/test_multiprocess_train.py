"""Drafter training over several processes (): a train step from
per-process rows equals one process's, batch parts are the whole batch's rows, checkpoints move
between 1 and 2 processes, a killed run resumes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import test_train
from test_multiprocess import DEVICES, ROOT, N, _worker, slow
from test_sharding import eight_device_env
from test_train import _train_args

from jspec import launch
from jspec.drafters.trained import load_drafter_file, to_flat

tiny_data = test_train.tiny_data  # the fixture: a tiny target and its datagen shards


# ----------------------------------------------------------------------------- training
@slow
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_two_processes_train_step_equals_one_process(tmp_path, kind):
    """One AdamW step of train_step on 2x4 over 2 processes, each process supplying only its 4
    of the 8 batch rows (`sharding.place_rows`), vs one device: same loss (rtol 1e-5), same
    parameters and moments (atol 1e-5)."""
    from mesh_cases import _train_inputs

    from train import drafters as tr

    out = tmp_path / "step.npz"
    with _worker("train-step", str(out), "--kind", kind) as group:
        cfg, params, frozen, batch, tx = _train_inputs(kind)
        statics = dict(kind=kind, cfg=cfg, tx=tx, vat_head=True, vat_weight=True)
        p1, s1, m1 = tr.train_step(params, tx.init(params), frozen,  # (fresh: donated)
                                   {k: np.asarray(v) for k, v in batch.items()}, **statics)
        res = group.wait().check()
    assert "process 0 supplies rows [0, 1, 2, 3] of 8" in res.output(0)
    assert "process 1 supplies rows [4, 5, 6, 7] of 8" in res.output(1)
    got = np.load(out)
    np.testing.assert_allclose(got["loss"], float(m1["loss"]), rtol=1e-5)
    for name, want in p1.items():
        np.testing.assert_allclose(got[f"param/{name}"], np.asarray(want), atol=1e-5,
                                   err_msg=name)
    for i, want in enumerate(jax.tree.leaves(s1)):
        np.testing.assert_allclose(got[f"opt/{i}"], np.asarray(want), atol=1e-5, rtol=1e-4)


def test_batch_parts_are_the_rows_of_the_whole_batch():
    """What a process builds of batch `step` with `part=` is exactly those rows of the whole
    batch (tokens, features, lengths, sampled positions), for both kinds; rows longer than the
    bucket are cut the same way."""
    from train import drafters as tr

    rng = np.random.default_rng(0)
    lengths = rng.integers(6, 90, 40)
    rows = tr.Rows(tokens=[rng.integers(0, 97, n).astype(np.int32) for n in lengths],
                   plens=[int(rng.integers(1, n - 3)) for n in lengths],
                   feats=[rng.standard_normal((n, 4, 8)).astype(np.float16) for n in lengths])
    plan = tr.batches_for(rows, (16, 64), 96)
    assert len({len(idx) for _, idx in plan}) > 1 and len(plan) > 2
    for kind, extra in (("eagle3", {"positions": 5}), ("dflash", {"anchors": 4})):
        args = type("Args", (), {"seed": 3, **extra})()
        cfg = type("Cfg", (), {"kind": kind})()
        for step in range(len(plan) + 2):  # into the second epoch
            whole = tr.batch_for_step(args, rows, plan, step, [0, 2], cfg)
            b = len(whole.lens)
            part = np.arange(b)[b // 2:]
            half = tr.batch_for_step(args, rows, plan, step, [0, 2], cfg, part=part)
            whole, half = vars(whole), vars(half)
            assert {k for k, v in half.items() if v is not None} == {
                k for k, v in whole.items() if v is not None}
            for k, v in whole.items():
                if v is not None:
                    np.testing.assert_array_equal(half[k], v[part], err_msg=f"{kind} {step} {k}")


def _train(tmp: Path, out: Path, steps: int, procs: int, extra: tuple[str, ...] = (),
           trace: Path | None = None, on_start=None) -> tuple[launch.LaunchResult | None, str]:
    """`python -m train dflash` on 2x4: over 2 processes (launcher, --distributed) or in 1
    process with 8 fake devices. Returns (launch result or None, process 0's output)."""
    args = _train_args(tmp, "dflash", out, steps, ["--mesh", "2x4", "--f32", "--ckpt-every", "2",
                                                    *extra])
    if procs == 1:
        r = subprocess.run([sys.executable, "-m", "train", *args], cwd=ROOT,
                           env=eight_device_env(), capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        return None, r.stdout + r.stderr
    cmd = [sys.executable, "-m", "train", *args, "--distributed"]
    if trace is not None:  # every file operation of each process, by rank
        cmd = ["sh", "-c", f'exec strace -f -qq -e trace=%file -o "{trace}/rank$JSPEC_PROCESS_ID" '
                           '"$@"', "sh", *cmd]
    res = launch.launch(cmd, N, devices=DEVICES, cwd=ROOT, timeout=900, on_start=on_start)
    return res, res.output(0)


MODIFYING = re.compile(r"^\d+\s+(rename|renameat2?|mkdir|mkdirat|unlink|unlinkat|rmdir|creat|"
                       r"truncate|link|linkat|symlink|symlinkat)\(")
OPEN_FOR_WRITING = re.compile(r"^\d+\s+open(?:at)?\(.*O_(?:WRONLY|RDWR|CREAT)")


def _written(trace: Path) -> set[str]:
    """Absolute paths a process opened for writing, created, renamed (both names), made or
    removed, from its `strace -f -e trace=%file` log (failed calls left out)."""
    paths = set()
    for line in trace.read_text().splitlines():
        if " = -1 " in line or not (MODIFYING.match(line) or OPEN_FOR_WRITING.match(line)):
            continue
        paths.update(p for p in re.findall(r'"([^"]*)"', line) if p.startswith("/"))
    return paths


def _log_steps(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]


def _params(out: Path) -> dict[str, np.ndarray]:
    return to_flat(load_drafter_file(out / "dflash.safetensors")[1])


@slow
@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_distributed_training_checkpoints_move_between_1_and_2_processes(tiny_data, tmp_path):
    """`python -m train dflash --distributed --mesh 2x4` under the launcher:
    - per-step losses equal the 1-process `--mesh 2x4` run (rtol 1e-5);
    - its Orbax checkpoint (step 4 of 8) resumes in one process (on the same 2x4 layout and on
      one device), and a 1-process checkpoint resumes in 2 processes: the drafters written
      equal the uninterrupted 1-process run's (atol 1e-5);
    - only process 0 writes the log, the vocabulary, the drafter file (strace of both
      processes): process 1's only writes in the run directory are its checkpoint shards."""
    tmp, _ = tiny_data
    steps, half = 8, 4
    ref = tmp_path / "ref"
    _train(tmp, ref, steps, 1)
    ref_log, ref_params = _log_steps(ref), _params(ref)

    two = tmp_path / "two"  # 2 processes to the end, traced
    trace = tmp_path / "trace"
    trace.mkdir()
    res, out0 = _train(tmp, two, steps, 2, trace=trace)
    res.check()
    assert "mesh {'data': 2, 'model': 4}" in out0 and "wrote" in out0
    assert "train dflash" not in res.output(1) and "step/s" not in res.output(1)
    np.testing.assert_allclose([x["loss"] for x in _log_steps(two)],
                               [x["loss"] for x in ref_log], rtol=1e-5)
    for k, v in ref_params.items():
        np.testing.assert_allclose(_params(two)[k], v, atol=1e-5, err_msg=k)
    written = {r: {p for p in _written(trace / f"rank{r}") if p.startswith(str(two))}
               for r in range(N)}
    for name in ("log.jsonl", "vocab.npy", "dflash.safetensors"):
        assert str(two / name) in written[0], (name, sorted(written[0]))
    assert written[1], "the trace saw no checkpoint shard of process 1"
    stray = sorted(p for p in written[1] if not p.startswith(str(two / "ckpt")))
    assert not stray, f"process 1 wrote outside its checkpoint shards: {stray}"

    # Checkpoints at step `half` of the same 8-step run (the schedule depends on --steps), from
    # 1 and from 2 processes; each resumed to the end in the other setting.
    one, two_half = tmp_path / "one", tmp_path / "two-half"
    _train(tmp, one, steps, 1, ("--stop-after", str(half)))
    _train(tmp, two_half, steps, 2, ("--stop-after", str(half)))[0].check()
    resumes = {"1 -> 2 processes": (one, 2, ()), "2 -> 1 process": (two_half, 1, ()),
               "2 processes -> 1 device": (two_half, 1, ("--mesh", ""))}
    for i, (name, (start, procs, extra)) in enumerate(resumes.items()):
        out = tmp_path / f"resume{i}"
        shutil.copytree(start, out)
        res, text = _train(tmp, out, steps, procs, extra)
        if res is not None:
            res.check()
        assert f"resumed from the checkpoint at step {half}" in text, name
        log = _log_steps(out)
        assert [x["step"] for x in log] == list(range(1, steps + 1)), name
        np.testing.assert_allclose([x["loss"] for x in log], [x["loss"] for x in ref_log],
                                   rtol=1e-5, err_msg=name)
        for k, v in ref_params.items():
            np.testing.assert_allclose(_params(out)[k], v, atol=1e-5, err_msg=f"{name}: {k}")


@slow
def test_a_killed_distributed_run_resumes_without_losing_a_finished_step(tiny_data, tmp_path):
    """SIGKILL to process 1 mid-run (after its 4th checkpoint): the launcher stops process 0 and
    fails the run; the rerun resumes at the last checkpoint both processes finished (none is
    lost, with a checkpoint every step) and ends with the uninterrupted run's drafter."""
    tmp, _ = tiny_data
    steps = 60
    ref = tmp_path / "ref"
    _train(tmp, ref, steps, 1, ("--ckpt-every", "1", "--eval-every", "0"))
    out = tmp_path / "killed"
    ck = out / "ckpt"
    killed_at: list[int] = []

    def kill_after_step_4(group: launch.ProcessGroup) -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            done = [int(p.name) for p in ck.iterdir() if p.name.isdigit()] if ck.is_dir() else []
            if done and max(done) >= 4:
                killed_at.append(max(done))
                os.kill(group.pids[1], signal.SIGKILL)
                return
            time.sleep(0.02)

    res, _ = _train(tmp, out, steps, 2, ("--ckpt-every", "1", "--eval-every", "0"),
                    on_start=kill_after_step_4)
    assert killed_at and not res.ok
    assert res.error.startswith("process 1 of 2 was killed by SIGKILL; stopped the others (0)")
    assert not (out / "dflash.safetensors").exists(), "finished before the kill: raise steps"
    finished = max(int(p.name) for p in ck.iterdir() if p.name.isdigit())
    assert killed_at[0] <= finished < steps
    res, text = _train(tmp, out, steps, 2, ("--ckpt-every", "1", "--eval-every", "0"))
    res.check()
    assert f"resumed from the checkpoint at step {finished}" in text
    print(f"process 1 killed once checkpoint {killed_at[0]} was there; {finished} was the last "
          f"finished; resumed at {finished}")
    after = [x["step"] for x in _log_steps(out)][-(steps - finished):]
    assert after == list(range(finished + 1, steps + 1))
    for k, v in _params(ref).items():
        np.testing.assert_allclose(_params(out)[k], v, atol=1e-5, err_msg=k)
