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
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import jspec
from jspec import launch

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "multiprocess_worker.py")
N, DEVICES = 2, 4  # one 2x4 mesh: data over the processes, model within each
slow = pytest.mark.slow


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

