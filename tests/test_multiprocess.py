"""jspec across processes: 2 processes x 4 CPU devices, one 2x4 mesh spanning both.

Each multi-process case runs `tests/multiprocess_worker.py` (or `python -m train`, `python -m
jspec`) as a group started by `jspec.launch` (process 0 holds the mesh's first `data` row, process
1 the second) and compares what process 0 wrote with the same computation in one process (this
one, on one device, or a one-process run on 8 fake devices). The launcher's own failure handling
is tested with plain Python children (no JAX: fast). Default run: the launcher tests and greedy
generation of the tiny models; everything else under `-m slow`.
"""

from __future__ import annotations

import io
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
from test_sharding import eight_device_env
from test_train import _train_args

import jspec
from jspec import launch
from jspec.drafters.trained import load_drafter_file, to_flat

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "multiprocess_worker.py")
N, DEVICES = 2, 4  # one 2x4 mesh: data over the processes, model within each
slow = pytest.mark.slow
tiny_data = test_train.tiny_data  # the fixture: a tiny target and its datagen shards


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _worker(*args: str, timeout: float = 900) -> launch.ProcessGroup:
    return launch.ProcessGroup([sys.executable, WORKER, *args], N, devices=DEVICES, cwd=ROOT,
                               timeout=timeout)


# ----------------------------------------------------------------------------- the launcher
def test_launcher_sets_the_rendezvous_and_collects_output_by_rank():
    code = ("import os; print('rank', os.environ['JSPEC_PROCESS_ID'], 'of', "
            "os.environ['JSPEC_NUM_PROCESSES'], os.environ['JSPEC_COORDINATOR'], "
            "os.environ['XLA_FLAGS'], os.environ['JAX_PLATFORMS'])")
    echo = io.StringIO()
    env = dict(os.environ, XLA_FLAGS="--xla_cpu_foo=1 --xla_force_host_platform_device_count=8")
    res = launch.launch(_py(code), 3, devices=4, timeout=60, echo=echo, env=env).check()
    assert res.ok and res.returncode == 0 and len(res.processes) == 3
    ports = set()
    for r in range(3):
        words = res.output(r).split()
        assert words[:4] == ["rank", str(r), "of", "3"]
        assert words[4].startswith("localhost:")
        ports.add(words[4])
        assert words[5:] == ["--xla_cpu_foo=1", "--xla_force_host_platform_device_count=4", "cpu"]
        assert f"[{r}] rank {r} of 3" in echo.getvalue()
    assert len(ports) == 1  # one coordinator for the group


def test_a_failing_process_fails_the_run_and_stops_the_others():
    code = ("import os, sys, time\n"
            "if os.environ['JSPEC_PROCESS_ID'] == '1':\n"
            "    print('bad input', flush=True); sys.exit(3)\n"
            "time.sleep(600)\n")
    t0 = time.monotonic()
    res = launch.launch(_py(code), N, timeout=120, grace=2)
    assert time.monotonic() - t0 < 30
    assert not res.ok and res.returncode == 3
    assert res.error == "process 1 of 2 exited with status 3; stopped the others (0)"
    assert res.processes[0].stopped and res.processes[0].returncode == -signal.SIGTERM
    assert not res.processes[1].stopped and "bad input" in res.output(1)
    assert not any(_alive(p.pid) for p in res.processes)
    with pytest.raises(launch.LaunchError, match=r"(?s)process 1 of 2 exited.*bad input"):
        res.check()


def test_a_hanging_group_is_stopped_at_the_timeout_with_what_it_started(tmp_path):
    """Each child starts a grandchild and sleeps; process 1 ignores SIGTERM. At the timeout
    every process group is ended (SIGTERM, then SIGKILL after the grace period): no child and no
    grandchild survives."""
    code = ("import os, signal, subprocess, sys, time\n"
            "r = os.environ['JSPEC_PROCESS_ID']\n"
            "g = subprocess.Popen(['sleep', '600'])\n"
            f"open(os.path.join({str(tmp_path)!r}, r), 'w').write(str(g.pid))\n"
            "if r == '1':\n"
            "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('ready', flush=True)\n"
            "time.sleep(600)\n")
    t0 = time.monotonic()
    res = launch.launch(_py(code), N, timeout=4, grace=1)
    elapsed = time.monotonic() - t0
    assert 4 <= elapsed < 20
    assert res.returncode == launch.TIMEOUT_EXIT
    assert "timed out after 4 s with processes 0, 1 still running" in res.error
    assert res.processes[0].returncode == -signal.SIGTERM
    assert res.processes[1].returncode == -signal.SIGKILL
    grandchildren = [int((tmp_path / str(r)).read_text()) for r in range(N)]
    time.sleep(0.2)
    assert not any(_alive(p) for p in [*grandchildren, *(p.pid for p in res.processes)])


def test_the_children_die_with_a_killed_launcher():
    """SIGKILL to the launcher itself (no chance to clean up): its children get SIGKILL from the
    kernel (PR_SET_PDEATHSIG, Linux)."""
    code = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-m", "jspec.launch", "-n", "2", "--", *_py(code)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    pids = []
    assert proc.stdout is not None
    for line in proc.stdout:
        pids += [int(m) for m in re.findall(r"^\[\d\] pid (\d+)", line)]
        if len(pids) == 2:
            break
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def test_launch_command_line():
    ok = subprocess.run([sys.executable, "-m", "jspec.launch", "-n", "2", "--devices", "3", "--",
                         *_py("import os; print(os.environ['XLA_FLAGS'])")],
                        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    for r in range(2):  # the launcher's device count replaces this process's; other flags stay
        flags = [ln.split()[1:] for ln in ok.stdout.splitlines() if ln.startswith(f"[{r}] ")]
        assert len(flags) == 1, ok.stdout
        assert [f for f in flags[0] if "device_count" in f] == [
            "--xla_force_host_platform_device_count=3"], ok.stdout
    bad = subprocess.run([sys.executable, "-m", "jspec.launch", "-n", "2", "--",
                          *_py("import os, sys; sys.exit(int(os.environ['JSPEC_PROCESS_ID']) * 5)")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 5 and "launch: process 1 of 2 exited with status 5" in bad.stderr
    usage = subprocess.run([sys.executable, "-m", "jspec.launch", "-n", "2"], capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
    assert usage.returncode == 2 and "usage" in usage.stderr


# ----------------------------------------------------------------------------- generate
def _reference_generate(model_kind: str, drafters: list[str], sampled: bool
                        ) -> dict[str, np.ndarray]:
    """The worker's generate cases in this process on one device."""
    from multiprocess_worker import _setup, generate_kwargs, prompts_for

    out = {}
    for name in drafters:
        model, drafter = _setup(model_kind, name)
        ids, lengths = prompts_for(model_kind, model)
        for t1 in [False, True] if sampled else [False]:
            res = jspec.generate(model, ids, lengths, **generate_kwargs(model_kind, drafter, t1))
            tag = f"{name}/{'t1' if t1 else 'greedy'}"
            out[f"{tag}/tokens"] = np.asarray(res.tokens)
            out[f"{tag}/lengths"] = np.asarray(res.lengths)
            out[f"{tag}/accepted"] = np.asarray(res.stats.accepted)
    return out


def _check_generate(tmp_path: Path, model_kind: str, drafters: list[str], sampled: bool,
                    meshes: tuple[str, ...] = ("2x4",)) -> dict:
    out = tmp_path / "gen.npz"
    args = ["generate", str(out), "--model", model_kind, "--drafters", ",".join(drafters),
            "--meshes", ",".join(meshes)] + (["--sampled"] if sampled else [])
    with _worker(*args) as group:  # the single-process reference runs meanwhile
        ref = _reference_generate(model_kind, drafters, sampled)
        res = group.wait().check()
    got = np.load(out)
    assert all((v > 0).all() for k, v in ref.items() if k.endswith("/lengths"))  # not empty
    for mesh in meshes:
        for key, want in ref.items():
            np.testing.assert_array_equal(got[f"{mesh}/{key}"], want,
                                          err_msg=f"{mesh}/{key}: 2 processes vs 1")
    for r in range(N):
        assert "fully addressable False" in res.output(r)  # the outputs did span both processes
    return json.loads(out.with_suffix(".json").read_text())


def test_two_processes_greedy_generate_equals_one_process(tmp_path):
    """Tiny target (heads, KV heads, MLP, vocabulary divisible by 4), 8 prompts of lengths 1-9,
    16 new tokens, k = 3: autoregressive, EAGLE-3 and DFlash on a 2x4 mesh over 2 processes give
    the one-device tokens, lengths and accepted counts exactly."""
    _check_generate(tmp_path, "tiny", ["autoregressive", "eagle3", "dflash"], sampled=False)


@slow
def test_two_processes_sampled_generate_equals_one_process(tmp_path):
    """T = 1 with a fixed key: the random stream does not depend on the partitioning (threefry
    is partitionable), so sampled tokens are identical too, not only equal in distribution."""
    assert jax.config.jax_threefry_partitionable
    _check_generate(tmp_path, "tiny", ["autoregressive", "eagle3", "dflash"], sampled=True)


@slow
def test_two_processes_greedy_generate_on_1x8_and_8x1(tmp_path):
    """The model axis across the processes (1x8: the tensor-parallel all-reduces cross them) and
    the data axis over all 8 devices (8x1)."""
    _check_generate(tmp_path, "tiny", ["autoregressive", "dflash"], sampled=False,
                    meshes=("1x8", "8x1"))


@slow
@pytest.mark.real
def test_two_processes_real_model_greedy_generate_equals_one_process(tmp_path):
    """SmolLM2-135M with the shipped EAGLE-3 and DFlash drafters, 4 chat prompts, 32 tokens."""
    _check_generate(tmp_path, "real", ["autoregressive", "eagle3", "dflash"], sampled=False)


@slow
@pytest.mark.parametrize("model_kind", ["tiny", pytest.param("real", marks=pytest.mark.real)])
def test_compiled_programs_issue_no_reduce_scatter(tmp_path, model_kind):
    """The collectives of jspec's 2-process programs (generate on 2x4: autoregressive / EAGLE-3
    / DFlash, greedy and T = 1, tiny or real target; one train step of each kind) are
    all-reduces, all-gathers and small collective-permutes: no reduce-scatter, the op with
    gloo's known problems on CPU (jax#40830: wrong results for large chunks; jax#40831: a fixed
    30 s timeout). Compiled only; prints the table docs/SCALING.md quotes."""
    found = {}
    out = tmp_path / "gen.npz"
    with _worker("generate", str(out), "--sampled", "--hlo", "--model", model_kind) as g:
        g.wait().check()
    found.update(json.loads(out.with_suffix(".json").read_text())["collectives"])
    for kind in ("eagle3", "dflash") if model_kind == "tiny" else ():
        out = tmp_path / f"{kind}.npz"
        with _worker("train-step", str(out), "--kind", kind, "--hlo") as g:
            g.wait().check()
        found.update(json.loads(out.with_suffix(".json").read_text())["collectives"])
    for name, c in found.items():
        print(f"{name}: {c['count']} largest bytes {c['largest_bytes']}")
    assert all("reduce-scatter" not in c["count"] for c in found.values()), found
    assert all(c["count"].get("all-reduce", 0) > 0 for c in found.values())


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
            b = len(whole["lens"])
            part = np.arange(b)[b // 2:]
            half = tr.batch_for_step(args, rows, plan, step, [0, 2], cfg, part=part)
            assert set(half) == set(whole)
            for k, v in whole.items():
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


# ----------------------------------------------------------------------------- failures
@slow
@pytest.mark.parametrize("dead", [0, 1])
def test_a_dead_process_ends_the_others(dead):
    """Process `dead` exits with status 3 after a first cross-process collective while the other
    keeps issuing collectives that can no longer complete.
    - Under the launcher (default): the run fails with "process D of 2 exited with status 3;
      stopped the others" within seconds.
    - Without the launcher's help (stop_on_failure=False, as on a cluster): JAX's runtime ends
      the survivor by itself once the dead peer misses its heartbeats (JSPEC_HEARTBEAT_TIMEOUT
      = 10 s here; JAX's default is 100 s), with an error that names the failure."""
    cmd = [sys.executable, WORKER, "die", "--rank", str(dead)]
    t0 = time.monotonic()
    res = launch.launch(cmd, N, devices=DEVICES, cwd=ROOT, timeout=300, grace=5)
    assert time.monotonic() - t0 < 60
    assert res.error == f"process {dead} of 2 exited with status 3; stopped the others " \
                        f"({1 - dead})", res.error
    assert "first sum 64.0" in res.output(1 - dead)

    env = dict(os.environ, **{launch.ENV_HEARTBEAT: "10"})
    t0 = time.monotonic()
    res = launch.launch(cmd, N, devices=DEVICES, cwd=ROOT, timeout=300, env=env,
                        stop_on_failure=False)
    took = time.monotonic() - t0
    survivor = res.processes[1 - dead]
    assert not survivor.stopped and survivor.returncode != 0, survivor.output[-3000:]
    assert "NOT STOPPED" not in survivor.output
    assert re.search(r"heartbeat|unhealthy|distributed service|Connection|coordination",
                     survivor.output), survivor.output[-3000:]
    print(f"dead process {dead}: the survivor ended after {took:.1f} s, exit status "
          f"{survivor.returncode}")
    assert took < 120


# ----------------------------------------------------------------------------- the CLI
@slow
@pytest.mark.real
def test_cli_generate_under_the_launcher_equals_one_process(real_model):
    """`python -m jspec generate --mesh 2x4` under the launcher, JSON (with the DFlash drafter)
    and streamed text (autoregressive): process 0 prints what one process prints; process 1
    prints none of it."""
    base = [sys.executable, "-m", "jspec", "generate", "--prompt", "Name three colours.",
            "--max-new-tokens", "24"]
    runs = {"json": ["--json", "--drafter", "smollm2-135m-dflash", "--k", "3"], "text": []}
    for name, extra in runs.items():
        one = subprocess.run([*base, *extra], cwd=ROOT, capture_output=True, text=True,
                             timeout=900, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        assert one.returncode == 0, one.stderr[-3000:]
        res = launch.launch([*base, *extra, "--mesh", "2x4"], N, devices=DEVICES, cwd=ROOT,
                            timeout=900).check()
        lines0 = [x for x in res.output(0).splitlines() if not x.startswith("[Gloo]")]
        if name == "json":
            want = json.loads(one.stdout.strip().splitlines()[-1])
            got = json.loads(next(x for x in lines0 if x.startswith("{")))
            assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
            assert got["rounds"] == want["rounds"]
            assert "{" not in res.output(1)
        else:
            assert one.stdout.strip() and one.stdout.strip() in res.output(0)
            assert one.stdout.strip().splitlines()[0] not in res.output(1)

